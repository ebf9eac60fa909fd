"""Benchmark: batch decoding of customer envelopes vs a plain fastavro per-record loop.

Prints records/s (median of several rounds) for the project's AvroDecoder.decode_batch and,
beside it, the baseline: ``fastavro.schemaless_reader`` on each payload after its header,
with the writer schema already parsed. Both run on one core, in this process, on the same
generated records: once where writer == reader, once resolving v1 -> v2.

    .venv/bin/python tests/bench/bench_avro_decode.py [--records 100000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import fastavro
from cdc_devkit.workload import WorkloadGenerator, WorkloadSpec
from cdc_shared.avro import AvroDecoder, FileSchemaRegistry
from cdc_shared.config.entities import EntityConfig

ROOT = Path(__file__).resolve().parents[2]


def records_per_second(decode: Callable[[], int], rounds: int) -> float:
    rates = []
    for _ in range(rounds):
        started = time.perf_counter()
        count = decode()
        rates.append(count / (time.perf_counter() - started))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core

    registry = FileSchemaRegistry([ROOT / "schemas"])
    customers = EntityConfig(
        name="customers",
        source_topic="dbserver1.inventory.customers",
        key=["id"],
        value_schema=ROOT / "schemas/dbserver1.inventory.customers-value.avsc",
    )
    spec = WorkloadSpec(
        events=args.records,
        keys=max(1000, args.records // 10),
        redelivery_share=0,
        poison_share=0,
        schema_change_at=None,
    )
    values = [
        m.value
        for m in WorkloadGenerator([customers], registry, spec).messages()
        if m.kind == "event"
    ][: args.records]
    v1, v2 = registry.versions("dbserver1.inventory.customers-value")
    size = sum(len(v) for v in values if v) / len(values)
    print(f"{len(values):,} customer envelopes, {size:.0f} bytes each on average, one core")
    print(f"{'case':<24}{'baseline rec/s':>16}{'decode_batch rec/s':>20}{'ratio':>8}")
    for label, reader in (("writer == reader", None), ("resolve v1 -> v2", v2)):
        reader_parsed = None if reader is None else reader.parsed

        def baseline(reader_parsed: object = reader_parsed) -> int:
            out = [
                fastavro.schemaless_reader(io.BytesIO(v[10:]), v1.parsed, reader_parsed)
                for v in values
                if v is not None
            ]
            return len(out)

        decoder = AvroDecoder(registry, reader)

        def batch(decoder: AvroDecoder = decoder) -> int:
            decoded = decoder.decode_batch(values)
            assert not decoded.errors
            return decoded.ok_count

        base = records_per_second(baseline, args.rounds)
        ours = records_per_second(batch, args.rounds)
        print(f"{label:<24}{base:>16,.0f}{ours:>20,.0f}{ours / base:>8.2f}")


if __name__ == "__main__":
    main()
