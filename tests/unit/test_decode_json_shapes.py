"""Which reader schemas the ingestor can read JSON against (refused at start otherwise)."""

from __future__ import annotations

import pytest
from cdc_ingestor.decode_json import UnsupportedJsonSchemaError, shape_of
from cdc_shared.avro import parse_schema


def _reader(*fields: dict[str, object]) -> object:
    return parse_schema({"type": "record", "name": "Envelope", "fields": list(fields)})


def test_a_top_level_payload_field_is_refused_it_would_look_wrapped() -> None:
    reader = _reader({"name": "payload", "type": "string"}, {"name": "op", "type": "string"})
    with pytest.raises(UnsupportedJsonSchemaError, match="'payload'"):
        shape_of(reader, "precise")  # type: ignore[arg-type]


def test_a_union_of_two_types_is_refused() -> None:
    reader = _reader({"name": "v", "type": ["null", "int", "string"]})
    with pytest.raises(UnsupportedJsonSchemaError, match="more than one non-null branch"):
        shape_of(reader, "precise")  # type: ignore[arg-type]


def test_optional_and_required_fields_are_told_apart() -> None:
    reader = _reader({"name": "a", "type": "long"}, {"name": "b", "type": ["null", "long"]})
    shape = shape_of(reader, "precise")  # type: ignore[arg-type]
    assert [(name, s.required) for name, s in shape.fields] == [("a", True), ("b", False)]
