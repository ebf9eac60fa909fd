# syntax=docker/dockerfile:1
#
# cdc-application: the four services as streaming queries of one Spark application
# (`cdc run`), for small deployments: one JVM, one heap, one JIT warm-up instead of four.
# Same tables, checkpoints and guarantees as the four service images: a deployment can
# switch between the two shapes on the same storage with nothing to migrate.
# Build the base first, then from the repository root:
#   docker build -f deploy/docker/base.Dockerfile -t cdc-base .
#   docker build -f deploy/docker/application.Dockerfile -t cdc-application .
# Run: mount the pipeline file at /etc/cdc/pipeline.yaml and the storage root; /health
# and /metrics (every service, labelled) answer on port 9100 (application.metrics_port),
# on loopback: to publish the port (docker run -p), also set application.metrics_host,
# e.g. -e CDC_APPLICATION__METRICS_HOST=0.0.0.0.

ARG BASE_IMAGE=cdc-base
FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="cdc-application" \
      org.opencontainers.image.description="ingestor, merger and publishers in one Spark application"
EXPOSE 9100
# On SIGTERM every service finishes its micro-batch in flight and the process exits 0.
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=4 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:9100/health', timeout=4).status == 200 else 1)"]
ENTRYPOINT ["tini", "--", "cdc", "run"]
CMD ["--config", "/etc/cdc/pipeline.yaml"]
