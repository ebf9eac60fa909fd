"""Watching the outputs: when probe changes reach the change topic and the index."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from cdc_devkit.oracle import load_fingerprints
from cdc_shared.clients.connect import make_consumer, make_elasticsearch
from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.pipeline import PipelineConfig

from .probes import ROOT, Key, Mark, Seq, decode_single_object

ES_POLL_S = 0.5


class TopicWatcher(threading.Thread):
    """Reads the change topics (read_committed) as they grow; notes when probes appear.

    Only probe keys' values are decoded: a key's bytes are looked up once, then cached.
    ``headers``: the baseline's messages carry key, sequence and op as headers.
    ``first_at``: when each table's first change event was read (any key): its first
    commit to the change topic, to within a poll. ``assigned`` is set once the consumer
    holds its partitions (the topics must exist then), so a watcher started before the
    pipeline misses no first event.
    """

    def __init__(
        self, config: PipelineConfig, probes: dict[str, dict[Key, int]], headers: bool
    ) -> None:
        super().__init__(daemon=True)
        self.config, self.probes, self.headers = config, probes, headers
        self.entity_of = {e.change_topic_name: e for e in config.entities}
        self.seen: dict[Mark, float] = {}
        self.last: dict[tuple[str, Key], tuple[Seq, str]] = {}
        self.commit_seq: dict[tuple[str, Key, int], Seq] = {}
        self.read = 0
        self.events_by_entity: Counter[str] = Counter()  # every change event, probe or not
        self.first_at: dict[str, float] = {}  # entity -> when its first change event was read
        self.assigned = threading.Event()
        self.done = threading.Event()
        self._schemas: dict[bytes, Any] = {}
        self._keys: dict[tuple[str, bytes], Key | None] = {}

    def _schema_table(self, fingerprint: bytes) -> dict[bytes, Any]:
        if fingerprint not in self._schemas:
            self._schemas = load_fingerprints(
                [Path(self.config.storage_root) / "_schemas", ROOT / "schemas" / "changes"]
            )
        return self._schemas

    def _decode(self, data: bytes) -> Any:
        return decode_single_object(data, self._schema_table(bytes(data[2:10])))

    def run(self) -> None:
        """Consume until ``done``."""
        consumer = make_consumer(
            self.config.kafka,
            f"bench-e2e-{uuid.uuid4().hex[:8]}",
            **{
                "isolation.level": "read_committed",
                "auto.offset.reset": "earliest",
                "topic.metadata.refresh.interval.ms": 2000,
            },
        )
        consumer.subscribe(list(self.entity_of), on_assign=lambda *_: self.assigned.set())
        try:
            while not self.done.is_set():
                messages = consumer.consume(5000, timeout=0.2)
                now = time.time()
                for message in messages:
                    if message.error() is None and message.value() is not None:
                        self._note(message, now)
                self.read += len(messages)
        finally:
            consumer.close()

    def _note(self, message: Any, now: float) -> None:
        entity = self.entity_of[message.topic()]
        self.events_by_entity[entity.name] += 1
        self.first_at.setdefault(entity.name, now)
        if self.headers:
            fields = {k: v for k, v in message.headers() or []}
            raw_key = fields["key"]
        else:
            raw_key = message.key()
        cached = (entity.name, raw_key)
        if cached not in self._keys:
            decoded = json.loads(raw_key) if self.headers else self._decode(raw_key)
            parts = tuple(decoded[k] for k in entity.key)
            self._keys[cached] = parts if parts in self.probes[entity.name] else None
        key = self._keys[cached]
        if key is None:
            return
        if self.headers:
            op = {"insert": "c", "update_postimage": "u", "delete": "d"}[fields["op"].decode()]
            seq = tuple(json.loads(fields["seq"]))
            version = int(fields["v"])
        else:
            event = self._decode(message.value())
            op, seq, version = event["op"], tuple(event["source_sequence"]), event["commit_version"]
        self.last[(entity.name, key)] = (seq, op)
        if op != "d":
            self.seen.setdefault((entity.name, key, seq), now)
            self.commit_seq[(entity.name, key, int(version))] = seq


class IndexWatcher(threading.Thread):
    """Searches the probe documents every ``ES_POLL_S`` (ids query, versions only).

    A search sees a document after the index's refresh, so the first search that returns
    a version is when that change became searchable (to within the polling interval).
    """

    def __init__(self, config: PipelineConfig, probes: dict[str, dict[Key, int]]) -> None:
        from cdc_publisher_es.documents import document_id

        super().__init__(daemon=True)
        self.config = config
        self.ids = {
            e.name: {document_id(list(k)): k for k in probes[e.name]} for e in config.entities
        }
        self.seen: dict[tuple[str, Key, int], float] = {}
        self.current: dict[tuple[str, Key], int | None] = {}
        self.searches = 0
        self.done = threading.Event()

    def run(self) -> None:
        """Poll until ``done``."""
        client = make_elasticsearch(self.config.elasticsearch)
        try:
            while not self.done.wait(ES_POLL_S):
                for entity in self.config.entities:
                    self._poll(client, entity)
        finally:
            client.close()

    def _poll(self, client: Any, entity: EntityConfig) -> None:
        ids = self.ids[entity.name]
        try:
            answer = client.search(
                index=entity.es_index_name,
                query={"ids": {"values": list(ids)}},
                size=len(ids),
                version=True,
                source=False,
            )
        except Exception:  # the index is not there yet
            return
        now = time.time()
        self.searches += 1
        found = {h["_id"]: int(h["_version"]) for h in answer["hits"]["hits"]}
        for doc_id, key in ids.items():
            version = found.get(doc_id)
            if self.current.get((entity.name, key)) != version:
                self.current[(entity.name, key)] = version
                if version is not None:
                    self.seen.setdefault((entity.name, key, version), now)


def index_sequence(
    entity: EntityConfig, key: Key, version: int, commit_seq: dict[tuple[str, Key, int], Seq]
) -> Seq | None:
    """The sequence a document version stands for (``changefeed.external_version``).

    One-column sequences: version = 2 x sequence (+1 for a delete); otherwise the silver
    commit version, resolved through what silver's change feed or the topic showed.
    """
    if len(entity.sequence_by) == 1:
        return None if version % 2 else (version // 2,)
    return commit_seq.get((entity.name, key, version))


def pending(
    config: PipelineConfig,
    expected: dict[tuple[str, Key], tuple[Seq, str]],
    topic: TopicWatcher,
    index: IndexWatcher | None,
) -> int:
    """Probe keys whose last produced change is not yet in the topic (and the index)."""
    entities = {e.name: e for e in config.entities}
    waiting = 0
    for (name, key), (seq, op) in list(expected.items()):
        last = topic.last.get((name, key))
        if op == "d":
            in_topic = last is None or last[1] == "d"
        else:
            in_topic = last is not None and last[0] == seq and last[1] != "d"
        in_index = True
        if index is not None:
            version = index.current.get((name, key))
            if op == "d":
                in_index = version is None
            else:
                in_index = version is not None and (
                    index_sequence(entities[name], key, version, topic.commit_seq) == seq
                )
        waiting += not (in_topic and in_index)
    return waiting
