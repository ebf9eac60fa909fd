# syntax=docker/dockerfile:1
#
# cdc-base: what every service image shares. Python 3.11 (slim, Debian bookworm), a
# headless JRE 17, the runtime Python dependencies at the exact versions of
# deploy/docker/constraints.txt, the project itself (not editable), the Avro schemas,
# and the jars every SparkSession loads (Delta, Spark's Kafka connector, spark-avro),
# fetched at build time through deploy/jvm (the `spark` module only: the Kafka broker
# and Elasticsearch distributions are not needed in a service image).
#
# Build from the repository root (the .dockerignore there keeps the context small):
#   docker build -f deploy/docker/base.Dockerfile -t cdc-base .
# No secret is baked in: credentials come at run time through ${env:...}/${file:...}
# references in the pipeline file.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG MAVEN_IMAGE=maven:3.9-eclipse-temurin-17

# ---- JVM artifacts ------------------------------------------------------------------
FROM ${MAVEN_IMAGE} AS jvm
WORKDIR /src
COPY deploy/jvm/ deploy/jvm/
# Writes the jars to /opt/cdc/jvm/spark: the layout cdc_shared.jvm.artifacts.spark_jars() reads
# from $CDC_JVM_CACHE.
RUN --mount=type=cache,target=/root/.m2 \
    mvn --batch-mode --quiet -f deploy/jvm/pom.xml -pl spark -Djvm.cache=/opt/cdc/jvm package \
 && ls /opt/cdc/jvm/spark/delta-spark_*.jar /opt/cdc/jvm/spark/spark-sql-kafka-*.jar \
       /opt/cdc/jvm/spark/spark-avro_*.jar

# ---- Python environment -------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS python
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# Dependencies first (a layer that changes only with constraints.txt), then the project.
COPY deploy/docker/constraints.txt deploy/docker/constraints.txt
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --requirement deploy/docker/constraints.txt
COPY pyproject.toml README.md ./
COPY shared/ shared/
COPY services/ services/
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --no-deps --constraint deploy/docker/constraints.txt . \
 && pip check

# ---- Runtime ------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
# tini is PID 1: it forwards SIGTERM to the service (which finishes its micro-batch and
# exits 0) and reaps what the JVM leaves behind.
RUN apt-get update \
 && mkdir -p /usr/share/man/man1 \
 && apt-get install --yes --no-install-recommends openjdk-17-jre-headless tini \
 && rm -rf /var/lib/apt/lists/* \
 && ln -s "$(dirname "$(dirname "$(readlink -f "$(command -v java)")")")" /opt/java \
 && groupadd --system --gid 10001 cdc \
 && useradd --system --uid 10001 --gid cdc --home-dir /home/cdc --create-home \
      --shell /usr/sbin/nologin cdc \
 && mkdir -p /data/_streams /data/_checkpoints \
 && chown -R cdc:cdc /data
COPY --from=python /opt/venv /opt/venv
COPY --from=jvm /opt/cdc/jvm/spark /opt/cdc/jvm/spark
COPY deploy/docker/spark-defaults.conf /opt/cdc/spark-conf/spark-defaults.conf
COPY deploy/docker/init_pipeline.py /opt/cdc/init_pipeline.py
COPY schemas/ /app/schemas/
ENV PATH=/opt/venv/bin:$PATH \
    JAVA_HOME=/opt/java \
    CDC_JVM_CACHE=/opt/cdc/jvm \
    SPARK_CONF_DIR=/opt/cdc/spark-conf \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/cdc
# The pipeline file is mounted here (compose: a bind mount; Kubernetes: a ConfigMap).
ENV CDC_CONFIG=/etc/cdc/pipeline.yaml
# /data is the storage root of the example configurations (tables and checkpoints).
WORKDIR /app
USER 10001:10001
# Fail the build, not the first start: Java 17 runs, every console script of the
# project imports, and the Spark jars are where the services look for them.
RUN java -version 2>&1 | grep -q '"17\.' \
 && python -c "from importlib.metadata import entry_points as e; [s.load() for s in e(group='console_scripts') if s.dist.name == 'cdc-delta']" \
 && python -c "from cdc_shared.jvm import artifacts; assert artifacts.spark_jars(), artifacts.jvm_cache_dir()"
