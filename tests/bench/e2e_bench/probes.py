"""The key space, sharded between the producers, and its probe keys (the keys followed).

Also what the modules share: ``ROOT``, the ``Key``/``Seq``/``Mark`` types, and reading a
key or an envelope off a message.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import fastavro
from cdc_devkit.workload import WorkloadGenerator, WorkloadSpec
from cdc_shared.avro import SchemaRegistry
from cdc_shared.clients.schemas import make_registry
from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.pipeline import PipelineConfig

ROOT = Path(__file__).resolve().parents[3]
Key = tuple[Any, ...]
Seq = tuple[int, ...]
Mark = tuple[str, Key, Seq]  # entity, key, sequence: one change event


class ShardGenerator(WorkloadGenerator):
    """The workload on every ``shards``-th key from ``shard``: producers never share a key.

    Per-key order then holds across producer processes, since each key has one producer.
    """

    def __init__(
        self,
        shard: int,
        shards: int,
        entities: Sequence[EntityConfig],
        registry: SchemaRegistry,
        spec: WorkloadSpec,
    ) -> None:
        self.shard, self.shards = shard, shards
        super().__init__(entities, registry, spec)

    def _key(self, state: Any, k: int) -> dict[str, Any]:
        return super()._key(state, k * self.shards + self.shard)

    def global_key(self, entity_index: int, k: int) -> dict[str, Any]:
        """The key of global key number ``k`` of the ``entity_index``-th entity."""
        return WorkloadGenerator._key(self, self.entities[entity_index], k)


def probe_numbers(keys: int, share: float, hot_keys: float, shards: int) -> list[int]:
    """Global key numbers that are probes: every n-th key, the hot keys left out.

    Hot keys change several times per micro-batch, so most of their changes never reach
    an output; their few survivors would skew the delay.
    """
    stride = max(1, round(1 / share))
    first_cold = (max(1, int(keys // shards * hot_keys)) + 1) * shards
    last = keys // shards * shards
    return [k for k in range(stride // 2, last, stride) if k >= first_cold]


def probe_keys(config: PipelineConfig, numbers: Sequence[int]) -> dict[str, dict[Key, int]]:
    """Per entity: probe key tuple -> global key number."""
    generator = ShardGenerator(
        0, 1, config.entities, make_registry(config), WorkloadSpec(events=0, keys=1)
    )
    out: dict[str, dict[Key, int]] = {}
    for index, entity in enumerate(config.entities):
        out[entity.name] = {
            tuple(generator.global_key(index, k)[f] for f in entity.key): k for k in numbers
        }
    return out


def sequence_of(envelope: dict[str, Any], paths: Sequence[str]) -> Seq:
    """The entity's ``sequence_by`` values of a decoded envelope."""
    values = []
    for path in paths:
        value: Any = envelope
        for part in path.split("."):
            value = value[part]
        values.append(int(value))
    return tuple(values)


def decode_single_object(data: bytes, schemas: dict[bytes, Any]) -> Any:
    """An Avro single-object encoding (marker, 8-byte fingerprint, body), by fingerprint."""
    return fastavro.schemaless_reader(io.BytesIO(data[10:]), schemas[bytes(data[2:10])], None)
