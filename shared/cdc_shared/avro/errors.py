"""Typed failures of Avro encoding and decoding; each says what failed and where to look.

The serde errors (:class:`AvroSerdeError`) are faults of a record: it goes to quarantine.
:class:`SchemaRegistryUnavailableError` is a fault of the registry: no record is to blame,
so it is never quarantined; the caller stops instead.
"""

from __future__ import annotations


class AvroSerdeError(ValueError):
    """Base of every serde failure. ``kind`` is a stable name for quarantine tables."""

    kind = "avro_error"


class TruncatedPayloadError(AvroSerdeError):
    """The bytes end before the framing header or the Avro datum is complete."""

    kind = "truncated"


class CorruptPayloadError(AvroSerdeError):
    """The bytes are not a valid Avro datum of the writer schema (or have trailing bytes)."""

    kind = "corrupt"


class UnknownFramingError(AvroSerdeError):
    """The first bytes are neither the Confluent (0x00) nor the single-object (C3 01) magic."""

    kind = "unknown_framing"


class UnknownSchemaError(AvroSerdeError):
    """The framing names a schema id or fingerprint no registry knows."""

    kind = "unknown_schema"


class IncompatibleSchemaError(AvroSerdeError):
    """The writer schema cannot be resolved to the reader schema."""

    kind = "incompatible_schema"


class NullKeyError(AvroSerdeError):
    """A message that must carry a key has none."""

    kind = "null_key"


class SchemaTypeError(AvroSerdeError):
    """A value does not match the schema it is encoded with (wrong type, missing field)."""

    kind = "wrong_type"


class SchemaRegistryUnavailableError(RuntimeError):
    """The schema registry did not answer a question a record depends on.

    Down, overloaded, refusing the credentials, out of reach, or answering something a
    registry does not: the request was retried with backoff for the configured budget
    (``schema_registry.retry_budget_s``) where retrying can help, then this is raised. Not
    an :class:`AvroSerdeError` on purpose: the records waiting for the answer are valid, so
    the stream fails (and resumes from its checkpoint when restarted) instead of
    quarantining them. The message names the registry (no credentials) and the status.
    """
