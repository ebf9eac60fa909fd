# syntax=docker/dockerfile:1
#
# cdc-ingestor: Kafka CDC topics -> bronze Delta (append-only change log).
# Build the base first, then from the repository root:
#   docker build -f deploy/docker/base.Dockerfile -t cdc-base .
#   docker build -f deploy/docker/ingestor.Dockerfile -t cdc-ingestor .
# Run: mount the pipeline file at /etc/cdc/pipeline.yaml and the storage root (/data in
# the example configurations); /health and /metrics answer on port 9101
# (ingestor.metrics_port), on loopback: to publish the port (docker run -p), also set
# ingestor.metrics_host, e.g. -e CDC_INGESTOR__METRICS_HOST=0.0.0.0.

ARG BASE_IMAGE=cdc-base
FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="cdc-ingestor" \
      org.opencontainers.image.description="Kafka CDC topics -> bronze Delta (append-only change log)"
EXPOSE 9101
# On SIGTERM the service finishes the running micro-batch (up to ~15 s under load) and
# exits 0; give it a stop grace period of 60-120 s (compose, Kubernetes).
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=4 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:9101/health', timeout=4).status == 200 else 1)"]
ENTRYPOINT ["tini", "--", "cdc-ingestor"]
CMD ["--config", "/etc/cdc/pipeline.yaml"]
