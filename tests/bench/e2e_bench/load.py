"""The load: the workload generator in producer processes, one share of the keys each."""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cdc_devkit.oracle import load_fingerprints
from cdc_devkit.workload import GeneratedMessage, WorkloadSpec, produce
from cdc_shared.clients.schemas import make_registry
from cdc_shared.config.pipeline import load_config

from .probes import ROOT, Key, Seq, ShardGenerator, decode_single_object, sequence_of


def producer_main(
    shard: int,
    shards: int,
    config_path: str,
    keys: int,
    events: int,
    seed: int,
    hot_tables: int,
    hot_tables_share: float,
    snapshot_rows: int | None,
    probes: dict[str, dict[Key, int]],
    commands: Any,
    results: Any,
) -> None:
    """One producer process: takes ("produce", count, rate) commands, answers with marks.

    A mark is (entity, key, sequence, op, time) of a probe key's change, taken as the
    message goes to the producer (its Kafka timestamp is set in the same call).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us
    config = load_config(config_path)
    spec = WorkloadSpec(
        events=events,
        keys=keys_of_shard(keys, shards),
        seed=seed + shard,
        poison_share=0.0,
        redelivery_share=0.0,
        schema_change_at=None,
        hot_tables=hot_tables,
        hot_tables_share=hot_tables_share,
        snapshot_rows=snapshot_rows,
    )
    generator = ShardGenerator(shard, shards, config.entities, make_registry(config), spec)
    wanted = {e.name: set(probes[e.name]) for e in config.entities}
    paths = {e.name: list(e.sequence_by) for e in config.entities}
    fingerprints = load_fingerprints([ROOT / "schemas"])
    marks: list[tuple[str, Key, Seq, str, float]] = []
    key_cache: dict[tuple[str, bytes], Key | None] = {}

    def watched(messages: Iterator[GeneratedMessage]) -> Iterator[GeneratedMessage]:
        for message in messages:
            if message.value is not None and message.key is not None:
                cached = (message.entity, message.key)
                if cached not in key_cache:
                    key = decode_single_object(message.key, fingerprints)
                    entity = next(e for e in config.entities if e.name == message.entity)
                    parts = tuple(key[f] for f in entity.key)
                    key_cache[cached] = parts if parts in wanted[message.entity] else None
                probe = key_cache[cached]
                if probe is not None:
                    envelope = decode_single_object(message.value, fingerprints)
                    marks.append(
                        (
                            message.entity,
                            probe,
                            sequence_of(envelope, paths[message.entity]),
                            str(envelope["op"]),
                            time.time(),
                        )
                    )
            yield message

    stream = watched(generator.messages())
    snapshot = snapshot_rows_of_shard(spec.keys, snapshot_rows) * len(config.entities)
    while True:
        command = commands.get()
        if command[0] == "stop":
            return
        _, count, rate = command
        count = snapshot if count is None else count
        report = produce(config.kafka, itertools.islice(stream, count), rate=rate)
        results.put((shard, report.produced, report.seconds, list(marks)))
        marks.clear()


def keys_of_shard(keys: int, shards: int) -> int:
    """The keys of each table that one of ``shards`` producers writes."""
    return max(1, keys // shards)


def snapshot_rows_of_shard(keys_of_shard: int, snapshot_rows: int | None) -> int:
    """The rows of each table's snapshot that one producer writes (half its keys by default)."""
    rows = keys_of_shard // 2 if snapshot_rows is None else snapshot_rows
    return min(rows, keys_of_shard)


class Load:
    """The producer processes, driven one step at a time."""

    def __init__(
        self, config_path: Path, args: argparse.Namespace, probes: dict[str, dict[Key, int]]
    ) -> None:
        context = mp.get_context("spawn")
        self.shards = args.producers
        #: Each table's snapshot rows, over all producers: one change event each.
        self.snapshot_rows = self.shards * snapshot_rows_of_shard(
            keys_of_shard(args.keys, self.shards), args.snapshot_rows
        )
        total = sum(int(r * args.seconds_per_rate) for r in args.rates)
        events = total // self.shards + 10_000
        self.results = context.Queue()
        self.commands = [context.Queue() for _ in range(self.shards)]
        self.workers = [
            context.Process(
                target=producer_main,
                args=(
                    shard,
                    self.shards,
                    str(config_path),
                    args.keys,
                    events,
                    args.seed,
                    args.hot,
                    args.hot_share,
                    args.snapshot_rows,
                    probes,
                    self.commands[shard],
                    self.results,
                ),
                daemon=True,
            )
            for shard in range(self.shards)
        ]
        for worker in self.workers:
            worker.start()

    def run(
        self, count: int | None, rate: float | None
    ) -> tuple[int, float, list[tuple[str, Key, Seq, str, float]]]:
        """Produce ``count`` messages (None: the snapshot) at ``rate`` in all; wait for it."""
        for queue in self.commands:
            share = None if count is None else count // self.shards
            queue.put(("produce", share, None if rate is None else rate / self.shards))
        produced, seconds, marks = 0, 0.0, []
        for _ in self.workers:
            _, n, s, m = self.results.get()
            produced, seconds = produced + n, max(seconds, s)
            marks.extend(m)
        return produced, seconds, marks

    def pids(self) -> dict[str, int]:
        """The producers' process ids (they share the bench's process group)."""
        return {f"producer-{i}": w.pid for i, w in enumerate(self.workers) if w.pid}

    def stop(self) -> None:
        """Ask every worker to end, then make sure it did."""
        for queue in self.commands:
            queue.put(("stop",))
        for worker in self.workers:
            worker.join(30)
            if worker.is_alive():
                worker.kill()
