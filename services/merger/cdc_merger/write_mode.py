"""Whether silver's MERGEs mark changed rows in deletion vectors or rewrite files.

A MERGE or DELETE that changes rows of a file can mark them deleted in a deletion vector
(it reads and writes little of the file, in ~7 more Spark jobs) or rewrite the file. On
a small table rewriting is the cheaper of the two, since the table is a file or two; on
a large one deletion vectors are (docs/benchmarks.md, "deletion vectors against
rewriting"). Delta writes deletion vectors only where the table's
``delta.enableDeletionVectors`` property is true, so the merger sets that property per
silver from its size: deletion vectors from ``merger.deletion_vectors_from_mib`` on, and
back to rewriting only below half of it, so a table near the line does not switch at
every batch. Checked when the table is opened and after each batch (the size comes from
the checksum of the version the batch committed, no Spark job); a change is one commit.
The table feature stays in silver's protocol either way, so readers see no change.

A history keeps deletion vectors at every size: its replacing write (a Delta
``replaceOn`` overwrite, ``history._replace_versions``) fails when it has to rewrite
files instead (Delta 4.4: ``DELTA_FILE_TO_OVERWRITE_NOT_FOUND``, the DELETE with an
``EXISTS`` condition cannot name the files it touched).
"""

from __future__ import annotations

import logging

from cdc_shared.jvm.bridge import delta_table_bytes
from cdc_shared.streaming.tables import on_conflict_retry, table_properties
from delta.tables import DeltaTable
from pyspark.sql import SparkSession

log = logging.getLogger("cdc_merger")

#: The table property Delta consults before it writes a deletion vector.
DELETION_VECTORS = "delta.enableDeletionVectors"


def deletion_vectors_wanted(size_bytes: int, from_bytes: int, have: bool) -> bool:
    """Whether a table of ``size_bytes`` should use deletion vectors (``have``: it does now).

    ``from_bytes`` 0: always. Otherwise from ``from_bytes`` on, and a table that has them
    keeps them down to half of it.
    """
    if from_bytes <= 0:
        return True
    return size_bytes >= (from_bytes // 2 if have else from_bytes)


class WriteMode:
    """Keeps one table's ``delta.enableDeletionVectors`` in line with its size."""

    def __init__(self, spark: SparkSession, path: str, from_mib: float) -> None:
        self.spark = spark
        self.path = path
        self.from_bytes = int(from_mib * 2**20)
        self.deletion_vectors: bool | None = None  # unknown until opened

    def open(self) -> None:
        """Read the table's property and size (its snapshot brought up to date) and set it."""
        DeltaTable.forPath(self.spark, self.path)  # loads the table's newest snapshot
        held = table_properties(self.spark, self.path).get(DELETION_VECTORS, "false")
        self.deletion_vectors = held.lower() == "true"
        self.check()

    def check(self) -> None:
        """Switch the property when the table's size says so (after a batch committed)."""
        if self.deletion_vectors is None:
            self.open()
            return
        size = delta_table_bytes(self.spark, self.path)
        wanted = deletion_vectors_wanted(size, self.from_bytes, self.deletion_vectors)
        if wanted != self.deletion_vectors:
            _set_deletion_vectors(self.spark, self.path, wanted)
            log.info(
                "silver's MERGEs now %s",
                "mark changed rows in deletion vectors" if wanted else "rewrite files",
                extra={"table": self.path, "size_mib": round(size / 2**20, 1)},
            )
            self.deletion_vectors = wanted


@on_conflict_retry
def _set_deletion_vectors(spark: SparkSession, path: str, enabled: bool) -> None:
    value = "true" if enabled else "false"
    spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('{DELETION_VECTORS}' = '{value}')")
