"""Pipelines on throwaway topics: a config file and its topic-named schema folder."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from cdc_shared.config.connections import ElasticsearchConfig, KafkaConfig
from cdc_shared.config.entity_sets import load_pipeline
from cdc_shared.config.pipeline import PipelineConfig

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"
ENTITIES = {
    "customers": {"key": ["id"], "sequence_by": ["source.lsn"], "source": "customers"},
    "orders": {
        "key": ["order_id", "line_no"],
        "sequence_by": ["source.ts_ms", "source.lsn"],
        "source": "orders",
    },
}


@dataclass
class Pipeline:
    """A pipeline configuration written to disk, with topic-named schema files."""

    path: Path
    root: Path
    schema_dir: Path
    run: str

    @property
    def config(self) -> PipelineConfig:
        return load_pipeline(self.path)

    def topic(self, entity: str) -> str:
        return f"pytest_{self.run}.inventory.{ENTITIES[entity]['source']}"

    def add_schema_version(self, entity: str, version: int) -> None:
        """Make a newer value schema known, as a producer deploying it would."""
        source = f"dbserver1.inventory.{ENTITIES[entity]['source']}-value.v{version}.avsc"
        shutil.copy(
            SCHEMAS / source, self.schema_dir / f"{self.topic(entity)}-value.v{version}.avsc"
        )


PipelineFactory = Callable[..., Pipeline]


def write_pipeline(
    folder: Path,
    kafka: KafkaConfig,
    es: ElasticsearchConfig,
    entities: tuple[str, ...] = ("customers", "orders"),
    entity_settings: Mapping[str, object] | None = None,
    overrides: Mapping[str, Mapping[str, object]] | None = None,
    **sections: object,
) -> Pipeline:
    """A pipeline over fresh topics and indexes in ``folder``; only version 1 of each value
    schema is known. ``entity_settings`` go into every entity (e.g. ``value_format``),
    ``overrides[name]`` into entity ``name`` only."""
    run = uuid.uuid4().hex[:8]
    schema_dir = folder / f"schemas-{run}"
    schema_dir.mkdir(parents=True)
    pipeline = Pipeline(folder / f"pipeline-{run}.yaml", folder / f"data-{run}", schema_dir, run)
    for name in entities:
        source = ENTITIES[name]["source"]
        for part in ("key", "value"):
            shutil.copy(
                SCHEMAS / f"dbserver1.inventory.{source}-{part}.avsc",
                schema_dir / f"{pipeline.topic(name)}-{part}.avsc",
            )
    document = {
        "storage_root": str(pipeline.root),
        "spark": {
            "master": "local[2]",
            "conf": {"spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "2"},
        },
        "kafka": {"bootstrap_servers": kafka.bootstrap_servers},
        "elasticsearch": {"hosts": es.hosts},
        "schema_registry": {"dirs": [str(schema_dir)]},
        "entities": [
            {
                "name": name,
                "source_topic": pipeline.topic(name),
                "key": ENTITIES[name]["key"],
                "sequence_by": ENTITIES[name]["sequence_by"],
                # Awkward on purpose: a hyphen and a segment starting with a digit are
                # valid Kafka and index names but not Avro names (names.avro_namespace).
                "change_topic": f"pytest-{run}.2026.{name}-changes",
                "es_index": f"pytest-{run}.{name}",
                **(entity_settings or {}),
                **(overrides or {}).get(name, {}),
            }
            for name in entities
        ],
        **sections,
    }
    pipeline.path.write_text(yaml.safe_dump(document))
    return pipeline


@pytest.fixture
def make_pipeline(
    tmp_path: Path, kafka_config: KafkaConfig, es_config: ElasticsearchConfig
) -> PipelineFactory:
    """Build pipelines with :func:`write_pipeline` in the test's temporary folder."""

    def build(
        entities: tuple[str, ...] = ("customers", "orders"),
        entity_settings: Mapping[str, object] | None = None,
        overrides: Mapping[str, Mapping[str, object]] | None = None,
        **sections: object,
    ) -> Pipeline:
        return write_pipeline(
            tmp_path, kafka_config, es_config, entities, entity_settings, overrides, **sections
        )

    return build
