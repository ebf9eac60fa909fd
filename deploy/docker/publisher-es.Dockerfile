# syntax=docker/dockerfile:1
#
# cdc-publisher-es: silver Change Data Feed -> Elasticsearch indexes.
# Build the base first, then from the repository root:
#   docker build -f deploy/docker/base.Dockerfile -t cdc-base .
#   docker build -f deploy/docker/publisher-es.Dockerfile -t cdc-publisher-es .
# Run: mount the pipeline file at /etc/cdc/pipeline.yaml and the storage root (/data in
# the example configurations); /health and /metrics answer on port 9104
# (publisher_es.metrics_port), on loopback: to publish the port (docker run -p), also set
# publisher_es.metrics_host, e.g. -e CDC_PUBLISHER_ES__METRICS_HOST=0.0.0.0.

ARG BASE_IMAGE=cdc-base
FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="cdc-publisher-es" \
      org.opencontainers.image.description="silver Change Data Feed -> Elasticsearch indexes"
EXPOSE 9104
# On SIGTERM the service finishes the running micro-batch (up to ~15 s under load) and
# exits 0; give it a stop grace period of 60-120 s (compose, Kubernetes).
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=4 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:9104/health', timeout=4).status == 200 else 1)"]
ENTRYPOINT ["tini", "--", "cdc-publisher-es"]
CMD ["--config", "/etc/cdc/pipeline.yaml"]
