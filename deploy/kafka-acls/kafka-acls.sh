#!/usr/bin/env bash
# Least-privilege ACLs for the pipeline's Kafka principals (one per service); the table
# in README.md says what each grant is for. Run as an admin of the cluster:
#
#   BOOTSTRAP=broker:9093 COMMAND_CONFIG=admin.properties \
#   SOURCE_TOPIC_PREFIX=dbserver1.inventory. CHANGE_TOPIC_PREFIX=cdc.inventory. \
#   deploy/kafka-acls/kafka-acls.sh            # DRY_RUN=1 prints the commands instead
#
# COMMAND_CONFIG holds the admin's client settings (security.protocol, sasl.*, ssl.*).
# KAFKA_ACLS is Kafka's kafka-acls.sh (default: the one on PATH). Idempotent: adding an
# ACL that exists is a no-op.
set -euo pipefail

: "${BOOTSTRAP:?set BOOTSTRAP (host:port of the brokers)}"
: "${COMMAND_CONFIG:?set COMMAND_CONFIG (the admin client properties file)}"
: "${SOURCE_TOPIC_PREFIX:?set SOURCE_TOPIC_PREFIX (the Debezium topics, e.g. dbserver1.inventory.)}"
: "${CHANGE_TOPIC_PREFIX:?set CHANGE_TOPIC_PREFIX (the change topics of publisher-kafka, e.g. cdc.)}"
PROGRESS_TOPIC="${PROGRESS_TOPIC:-_cdc_publisher_progress}"   # publisher_kafka.progress_topic
INGESTOR="${INGESTOR_PRINCIPAL:-User:cdc-ingestor}"
PUBLISHER="${PUBLISHER_PRINCIPAL:-User:cdc-publisher-kafka}"
OPERATOR="${OPERATOR_PRINCIPAL:-User:cdc-operator}"            # the `cdc` CLI (status, verify)
# `cdc run` (the four services in one application) connects as one principal: give it
# both services' rows with INGESTOR_PRINCIPAL=PUBLISHER_PRINCIPAL=User:cdc-application.
# publisher-kafka's transactional ids and progress groups: cdc-publisher-kafka.<change topic>,
# so they all start with cdc-publisher-kafka.<change prefix>
PUBLISHER_IDS="cdc-publisher-kafka.${CHANGE_TOPIC_PREFIX}"
KAFKA_ACLS="${KAFKA_ACLS:-kafka-acls.sh}"

acl() {
  local command=("$KAFKA_ACLS" --bootstrap-server "$BOOTSTRAP" --command-config "$COMMAND_CONFIG" --add "$@")
  if [[ -n "${DRY_RUN:-}" ]]; then
    printf '%q ' "${command[@]}"; echo
  else
    "${command[@]}"
  fi
}

# cdc-ingestor: reads its source topics (Spark assigns partitions: no group is joined).
acl --allow-principal "$INGESTOR" --operation Read --operation Describe \
    --topic "$SOURCE_TOPIC_PREFIX" --resource-pattern-type prefixed

# cdc-publisher-kafka: writes its change topics and the progress topic in transactions
# under its own transactional ids, commits its progress groups, reads back the last
# offsets of its change topics and their max.message.bytes (DescribeConfigs).
acl --allow-principal "$PUBLISHER" --operation Write --operation Describe --operation Read \
    --operation DescribeConfigs --topic "$CHANGE_TOPIC_PREFIX" --resource-pattern-type prefixed
acl --allow-principal "$PUBLISHER" --operation Write --operation Describe --operation Read \
    --topic "$PROGRESS_TOPIC"
acl --allow-principal "$PUBLISHER" --operation Write --operation Describe \
    --transactional-id "$PUBLISHER_IDS" --resource-pattern-type prefixed
acl --allow-principal "$PUBLISHER" --operation Read --operation Describe \
    --group "$PUBLISHER_IDS" --resource-pattern-type prefixed
# Only if publisher-kafka should create missing change topics itself (else an admin
# creates them, with the partitions and replication the cluster needs):
if [[ -n "${PUBLISHER_CREATES_TOPICS:-}" ]]; then
  acl --allow-principal "$PUBLISHER" --operation Create \
      --topic "$CHANGE_TOPIC_PREFIX" --resource-pattern-type prefixed
fi

# The operator (`cdc status`, `cdc verify`): describes topics and groups, reads offsets.
acl --allow-principal "$OPERATOR" --operation Describe \
    --topic "$SOURCE_TOPIC_PREFIX" --resource-pattern-type prefixed
acl --allow-principal "$OPERATOR" --operation Describe --operation Read \
    --topic "$CHANGE_TOPIC_PREFIX" --resource-pattern-type prefixed
acl --allow-principal "$OPERATOR" --operation Describe \
    --group "$PUBLISHER_IDS" --resource-pattern-type prefixed
# publisher-kafka's progress is its groups' offsets on this topic: reading a group's
# offset needs Describe on the topic too.
acl --allow-principal "$OPERATOR" --operation Describe --topic "$PROGRESS_TOPIC"
for group in cdc-cli- cdc-verify-; do  # its own consumers' groups (cdc-cli-status, ...)
  acl --allow-principal "$OPERATOR" --operation Describe --operation Read \
      --group "$group" --resource-pattern-type prefixed
done
