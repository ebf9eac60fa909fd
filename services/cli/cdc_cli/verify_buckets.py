"""Key buckets for ``cdc verify``: spill each side to local files, compare bucket by bucket.

A side (silver, or one target) is a stream of records ``(key, content hash, position)``:
``key`` is the canonical key as JSON text, the hash ``None`` for a delete, and the
position orders records of one key (a topic's offset: a key lives in one partition, so
the later offset wins). Each record goes to bucket ``bucket_of(key) % N`` in a file of a
temporary folder; a bucket's *live* keys are then its last record per key, deletes
dropped. Two sides agree on a bucket when their digests match: the number of live keys
and the XOR of a 128-bit hash of each (key, content hash) pair, which is independent of
order. Only buckets whose digests differ are compared key by key, giving the keys
missing from the target, extra in it, or with different content. A side that must hold
one record per key (the history's current versions) is spilled ``one_per_key``: a key
recorded twice there is live with content ``REPEATED``, so it differs from silver's.

Memory: records wait in a write buffer of at most ``BUFFER_CHARS`` characters before
they are appended to their bucket's file, so reading a side holds the buffer and N
digests; comparing holds one bucket of each side (its distinct keys: a key with many
events in a topic costs one entry). With ``N = rows / ROWS_PER_BUCKET`` a bucket holds
about ``ROWS_PER_BUCKET`` keys (a few MiB of Python objects) whatever the table's size.
Disk: about 100 bytes per record and side, in ``$TMPDIR``.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The keys a bucket holds on average when N comes from the row count.
ROWS_PER_BUCKET = 20_000
#: The most buckets: beyond it buckets grow rather than the number of files.
MAX_BUCKETS = 65_536
#: Characters of records held before they are appended to their buckets' files.
BUFFER_CHARS = 16 * 1024 * 1024

KINDS = ("missing", "extra", "different")
#: The content of a key recorded more than once on a ``one_per_key`` side: no hash.
REPEATED = "repeated"

#: A bucket's digest: (live keys, XOR of a 128-bit hash of each key with its content hash).
Digest = tuple[int, int]


def bucket_count(rows: int, rows_per_bucket: int = ROWS_PER_BUCKET) -> int:
    """N for a table of ``rows`` rows: about ``rows_per_bucket`` keys per bucket."""
    return max(1, min(MAX_BUCKETS, math.ceil(rows / rows_per_bucket)))


def bucket_of(key: str, buckets: int) -> int:
    """The bucket of a canonical key (stable across processes, unlike ``hash()``)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % buckets


def key_text(key: Iterable[Any]) -> str:
    """A canonical key (a tuple of canonical values) as the JSON text the buckets use."""
    return json.dumps(list(key), separators=(",", ":"))


def key_tuple(text: str) -> tuple[Any, ...]:
    """The canonical key back from its JSON text."""
    return tuple(json.loads(text))


def _pair_hash(key: str, content: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\t{content}".encode(), digest_size=16).digest())


def digest(live: dict[str, str]) -> Digest:
    """The digest of a bucket's live keys (key -> content hash)."""
    combined = 0
    for key, content in live.items():
        combined ^= _pair_hash(key, content)
    return len(live), combined


class BucketSpill:
    """One side's records, spilled to one local file per bucket under ``folder``.

    ``add`` every record, then read buckets back with ``live``. ``digest_as_added`` is
    kept while adding, so a side whose every key is added once with content (silver: one
    row per key) has its digests without reading its files back; for a side with deletes
    or several records per key (a topic) only ``digest(spill.live(b))`` is right.

    ``one_per_key``: the side must hold one record per key, so a key recorded twice is
    live with content ``REPEATED`` instead of its last record's.
    """

    def __init__(self, folder: Path, buckets: int, one_per_key: bool = False) -> None:
        self.folder = folder
        self.buckets = buckets
        self.one_per_key = one_per_key
        self.records = 0
        self._added: list[Digest] = [(0, 0)] * buckets
        self._buffer: dict[int, list[str]] = {}
        self._buffered = 0
        folder.mkdir(parents=True, exist_ok=True)

    def add(self, key: str, content: str | None, position: int) -> None:
        """Record ``key`` with its content hash (``None``: deleted) at ``position``."""
        bucket = bucket_of(key, self.buckets)
        line = f"{position}\t{content or '-'}\t{key}\n"
        self._buffer.setdefault(bucket, []).append(line)
        self._buffered += len(line)
        self.records += 1
        if content is not None:
            count, combined = self._added[bucket]
            self._added[bucket] = (count + 1, combined ^ _pair_hash(key, content))
        if self._buffered >= BUFFER_CHARS:
            self.flush()

    def flush(self) -> None:
        """Append the buffered records to their buckets' files."""
        for bucket, lines in self._buffer.items():
            with self._path(bucket).open("a", encoding="utf-8") as file:
                file.writelines(lines)
        self._buffer.clear()
        self._buffered = 0

    def digest_as_added(self, bucket: int) -> Digest:
        """The digest of every record added with content (see the class docstring)."""
        return self._added[bucket]

    def live(self, bucket: int) -> dict[str, str]:
        """The bucket's live keys: the last record per key by position, deletes dropped.

        On a ``one_per_key`` side a key recorded twice is live as ``REPEATED``.
        """
        self.flush()
        path = self._path(bucket)
        if not path.exists():
            return {}
        last: dict[str, tuple[int, str]] = {}
        with path.open(encoding="utf-8") as file:
            for line in file:
                position_text, content, key = line.rstrip("\n").split("\t", 2)
                position = int(position_text)
                seen = last.get(key)
                if seen is not None and self.one_per_key:
                    last[key] = (max(position, seen[0]), REPEATED)
                elif seen is None or position >= seen[0]:
                    last[key] = (position, content)
        return {key: content for key, (_, content) in last.items() if content != "-"}

    def _path(self, bucket: int) -> Path:
        return self.folder / f"{bucket:05d}.tsv"


@dataclass
class BucketComparison:
    """A target's side against silver's, bucket by bucket."""

    buckets: int  # buckets compared
    buckets_differing: int = 0  # buckets whose digests differed: compared key by key
    rows: int = 0  # live keys in the target
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    examples: dict[str, list[tuple[Any, ...]]] = field(default_factory=dict)  # a few keys


def compare_spills(silver: BucketSpill, target: BucketSpill, examples: int) -> BucketComparison:
    """Compare every bucket's digests, and the keys of the buckets that differ.

    ``silver`` must hold one record with content per key (its digests are those kept
    while adding); ``target`` any records (its buckets are read back one at a time).
    Example keys are the first few of each kind in the order of their ``repr``.
    """
    if silver.buckets != target.buckets:
        raise ValueError(f"silver has {silver.buckets} buckets, the target {target.buckets}")
    result = BucketComparison(silver.buckets)
    for bucket in range(silver.buckets):
        got = target.live(bucket)
        result.rows += len(got)
        if digest(got) == silver.digest_as_added(bucket):
            continue
        result.buckets_differing += 1
        expected = silver.live(bucket)
        found = {
            "missing": [k for k in expected if k not in got],
            "extra": [k for k in got if k not in expected],
            "different": [k for k in expected if k in got and got[k] != expected[k]],
        }
        for kind, keys in found.items():
            result.counts[kind] += len(keys)
            if keys:
                shown = result.examples.get(kind, []) + [key_tuple(k) for k in keys]
                result.examples[kind] = heapq.nsmallest(examples, shown, key=repr)
    result.examples = {kind: result.examples.get(kind, []) for kind in KINDS if result.counts[kind]}
    return result
