"""Clients of the servers the pipeline depends on: Kafka, Elasticsearch, the registry, delta-rs."""
