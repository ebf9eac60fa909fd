"""Avro for the pipeline: schema registries, framings, encoders and batch decoders."""

from cdc_shared.avro.errors import (
    AvroSerdeError,
    CorruptPayloadError,
    IncompatibleSchemaError,
    NullKeyError,
    SchemaRegistryUnavailableError,
    SchemaTypeError,
    TruncatedPayloadError,
    UnknownFramingError,
    UnknownSchemaError,
)
from cdc_shared.avro.framing import Framing, Header, read_header
from cdc_shared.avro.registry import (
    ConfluentSchemaRegistry,
    FileSchemaRegistry,
    KnownSchema,
    SchemaRegistry,
    load_schema_file,
    parse_schema,
    subject_name,
)
from cdc_shared.avro.serde import AvroDecoder, AvroEncoder, DecodedBatch

__all__ = [
    "AvroDecoder",
    "AvroEncoder",
    "AvroSerdeError",
    "ConfluentSchemaRegistry",
    "CorruptPayloadError",
    "DecodedBatch",
    "FileSchemaRegistry",
    "Framing",
    "Header",
    "IncompatibleSchemaError",
    "KnownSchema",
    "NullKeyError",
    "SchemaRegistry",
    "SchemaRegistryUnavailableError",
    "SchemaTypeError",
    "TruncatedPayloadError",
    "UnknownFramingError",
    "UnknownSchemaError",
    "load_schema_file",
    "parse_schema",
    "read_header",
    "subject_name",
]
