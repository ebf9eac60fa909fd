#!/usr/bin/env bash
# Makes sure the system tools the project needs are present: Python 3.11, Java 17 (Spark,
# Kafka, Kafka Connect), Java 21+ (Elasticsearch 9), Maven and PostgreSQL 15 (the Debezium
# source of `cdc infra up --with-postgres`). Installs what is missing from Debian's
# packages when run as root; otherwise says what to install.
set -euo pipefail

missing=()
command -v python3.11 >/dev/null || missing+=(python3.11 python3.11-venv)
command -v java >/dev/null || missing+=(openjdk-17-jre-headless)
command -v mvn >/dev/null || missing+=(maven)
[ -x "${CDC_INFRA_POSTGRES_BIN:-/usr/lib/postgresql/15/bin}/postgres" ] || missing+=(postgresql-15)

java21=""
for home in "${CDC_ES_JAVA_HOME:-}" "${JAVA_HOME:-}" /usr/lib/jvm/*; do
  [ -n "$home" ] && [ -f "$home/release" ] || continue
  major=$(sed -n 's/^JAVA_VERSION="\([0-9]*\).*/\1/p' "$home/release")
  if [ -n "$major" ] && [ "$major" -ge 21 ]; then java21=$home; break; fi
done
[ -n "$java21" ] || missing+=(openjdk-21-jre-headless)

[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
  echo "installing missing system packages: ${missing[*]}"
  # `cdc infra` runs a PostgreSQL of its own: Debian's package need not make (and, where
  # an init system runs, start) a cluster on port 5432.
  mkdir -p /etc/postgresql-common/createcluster.d
  echo "create_main_cluster = false" >/etc/postgresql-common/createcluster.d/cdc-delta.conf
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
else
  echo "missing system packages: ${missing[*]}; install them (e.g. sudo apt-get install ${missing[*]})" >&2
  exit 1
fi
