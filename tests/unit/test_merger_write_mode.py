"""When a silver's MERGEs switch between rewriting files and deletion vectors."""

from __future__ import annotations

import pytest
from cdc_merger.write_mode import deletion_vectors_wanted

MIB = 2**20


@pytest.mark.parametrize(
    ("size", "have", "wanted"),
    [
        (0, False, False),  # a new, empty silver rewrites
        (2 * MIB - 1, False, False),
        (2 * MIB, False, True),  # reached the size: deletion vectors
        (MIB, True, True),  # shrunk to half: keeps them (no switching at every batch)
        (MIB - 1, True, False),  # under half: rewriting again
    ],
)
def test_deletion_vectors_from_the_size_with_a_margin_back(
    size: int, have: bool, wanted: bool
) -> None:
    assert deletion_vectors_wanted(size, 2 * MIB, have) is wanted


@pytest.mark.parametrize("have", [False, True])
def test_zero_means_deletion_vectors_at_every_size(have: bool) -> None:
    assert deletion_vectors_wanted(0, 0, have) is True
