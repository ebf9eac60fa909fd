"""The ``cdc.replay.of`` header's form, as the CLI writes and reads it back."""

from __future__ import annotations

import pytest
from cdc_shared.contracts.replay_origin import Origin, origin_header, parse_origin


def test_a_header_names_the_coordinates_it_was_written_with() -> None:
    origin = Origin("dbserver1.inventory.customers-2", 7, 2**63 - 1)
    assert origin_header(origin) == b"dbserver1.inventory.customers-2/7/9223372036854775807"
    assert parse_origin(origin_header(origin)) == origin
    assert parse_origin(origin_header(origin).decode()) == origin


@pytest.mark.parametrize(
    "value",
    [
        None,
        b"",
        b"topic/1",  # no offset
        b"topic/1/2/3",  # a topic cannot hold '/'
        b"/1/2",  # no topic
        b"topic/-1/2",
        b"topic/1/x",
        b"topic/1/2\n",
        b" topic/1/2",
        b"top ic/1/2",  # not a legal topic name
        b"topic/2147483648/2",  # partition beyond an int
        b"topic/1/9223372036854775808",  # offset beyond a long
        b"topic/1/\xff",  # not UTF-8
    ],
)
def test_anything_else_is_not_a_replay_origin(value: bytes | None) -> None:
    assert parse_origin(value) is None
