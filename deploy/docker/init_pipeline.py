"""One-shot set-up before the services start (docker-compose's ``init`` service).

With ``schema_registry.url`` set, the services find each entity's source schemas under
the TopicNameStrategy subjects (``<source_topic>-key`` / ``-value``) of the registry, so
a fresh registry needs them before the ingestor starts. This registers every ``.avsc``
the file registry would know (the ``schema_registry.dirs`` folders and the pinned files;
``<subject>[.vN].avsc``, versions in order), checks that every entity resolves, and
creates the entities' source topics. Both steps are idempotent: a registry returns the
existing id for a schema it has, and an existing topic is left as it is.

    python init_pipeline.py --config /etc/cdc/pipeline.yaml [--partitions 3]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from cdc_shared.avro.registry import KnownSchema, SchemaRegistry, load_schema_file
from cdc_shared.clients.connect import make_admin
from cdc_shared.clients.schemas import entity_schemas, make_registry
from cdc_shared.config.pipeline import PipelineConfig, load_config
from cdc_shared.config.values import ConfigError
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import NewTopic


def schema_files(config: PipelineConfig) -> dict[str, list[KnownSchema]]:
    """Subject -> its versions, oldest first, from the folders and the pinned files."""
    paths: list[Path] = []
    for folder in config.schema_registry.dirs:
        if folder.is_dir():
            paths.extend(sorted(folder.glob("*.avsc")))
    for entity in config.entities:
        paths.extend(p for p in (entity.key_schema, entity.value_schema) if p is not None)
    by_subject: dict[str, dict[int, KnownSchema]] = defaultdict(dict)
    for path in dict.fromkeys(paths):  # a pinned file may also sit in a folder
        known = load_schema_file(path)
        assert known.subject is not None and known.version is not None
        by_subject[known.subject][known.version] = known
    return {s: [v[n] for n in sorted(v)] for s, v in sorted(by_subject.items())}


def register_source_schemas(config: PipelineConfig, registry: SchemaRegistry) -> list[str]:
    """Register the schema files in ``registry``; a line per subject for the log.

    Raises the service's own error (e.g. UnknownSchemaError) if an entity still cannot
    find its key or value schema afterwards, so the failure shows here, not later.
    """
    report = []
    for subject, versions in schema_files(config).items():
        for known in versions:
            registry.register(subject, known.definition)
        report.append(f"{subject}: {len(versions)} version(s)")
    for entity in config.entities:
        entity_schemas(entity, registry)
    return report


def create_source_topics(config: PipelineConfig, partitions: int, timeout_s: float) -> list[str]:
    """Create the entities' source topics that do not exist yet; the names created."""
    admin = make_admin(config.kafka)
    existing = set(admin.list_topics(timeout=timeout_s).topics)
    missing = [e.source_topic for e in config.entities if e.source_topic not in existing]
    if not missing:
        return []
    futures = admin.create_topics(
        [NewTopic(topic, num_partitions=partitions) for topic in missing],
        operation_timeout=timeout_s,
    )
    created = []
    for topic, future in futures.items():
        try:
            future.result(timeout=timeout_s)
            created.append(topic)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:  # a race: fine
                raise
    return created


def main(argv: list[str] | None = None) -> int:
    """Register the schemas (if a registry is configured) and create the source topics."""
    parser = argparse.ArgumentParser(prog="init_pipeline", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="pipeline YAML (default: $CDC_CONFIG)")
    parser.add_argument("--partitions", type=int, default=3, help="of the topics it creates")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per Kafka call")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
        if config.schema_registry.url:
            for line in register_source_schemas(config, make_registry(config)):
                print(f"registered {line}", flush=True)
        for topic in create_source_topics(config, args.partitions, args.timeout):
            print(f"created topic {topic} ({args.partitions} partitions)", flush=True)
    except (ConfigError, ValueError) as exc:
        print(f"init failed: {exc}", file=sys.stderr)
        return 2
    print("init done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
