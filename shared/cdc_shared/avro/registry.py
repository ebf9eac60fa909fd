"""Where writer and reader schemas come from: .avsc files, or a Confluent-compatible registry.

Both registries answer the same questions: which schema does this framing header name,
which is the newest schema of a subject (``<topic>-key`` / ``<topic>-value``, the
TopicNameStrategy), and register a schema derived at run time. Parsed schemas are cached.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fastavro
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient, SchemaRegistryError
from fastavro.schema import fingerprint as _fingerprint
from fastavro.schema import to_parsing_canonical_form

from cdc_shared.avro.errors import UnknownSchemaError
from cdc_shared.avro.framing import (
    Framing,
    Header,
    confluent_header,
    single_object_header,
)

_VERSIONED_FILE = re.compile(r"^(?P<subject>.+?)(?:\.v(?P<version>\d+))?\.avsc$")


@dataclass(frozen=True, eq=False)
class KnownSchema:
    """A schema with everything needed to write or read it."""

    definition: Mapping[str, Any] = field(repr=False)  # the JSON form, as registered
    parsed: Any = field(repr=False)  # fastavro's parsed form
    fingerprint: bytes  # CRC-64-AVRO of the canonical form, wire (little-endian) order
    subject: str | None = None
    version: int | None = None
    schema_id: int | None = None  # set when a Confluent registry knows it

    @property
    def header(self) -> bytes:
        """The framing header a message written with this schema starts with."""
        if self.schema_id is not None:
            return confluent_header(self.schema_id)
        return single_object_header(self.fingerprint)

    @property
    def full_name(self) -> str:
        """The Avro full name of the top-level type (e.g. ``ns.Envelope``)."""
        return str(self.parsed.get("name", self.parsed.get("type")))

    def json(self) -> str:
        """The schema as a JSON string."""
        return json.dumps(self.definition)


def parse_schema(
    definition: Mapping[str, Any] | str,
    *,
    subject: str | None = None,
    version: int | None = None,
    schema_id: int | None = None,
) -> KnownSchema:
    """Parse a schema (dict or JSON text) and fingerprint it."""
    as_dict = json.loads(definition) if isinstance(definition, str) else dict(definition)
    parsed = fastavro.parse_schema(as_dict)
    fingerprint_hex = _fingerprint(to_parsing_canonical_form(parsed), "CRC-64-AVRO")
    return KnownSchema(
        definition=as_dict,
        parsed=parsed,
        fingerprint=bytes.fromhex(fingerprint_hex),
        subject=subject,
        version=version,
        schema_id=schema_id,
    )


def load_schema_file(path: Path) -> KnownSchema:
    """Read one ``.avsc`` file; the name says subject and version (``<subject>[.vN].avsc``)."""
    match = _VERSIONED_FILE.match(path.name)
    subject = match.group("subject") if match else path.stem
    version = int(match.group("version") or 1) if match else 1
    try:
        definition = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UnknownSchemaError(f"cannot read schema file {path}: {exc}") from None
    return parse_schema(definition, subject=subject, version=version)


def _text(schema: Schema, what: str) -> str:
    if schema.schema_str is None:
        raise UnknownSchemaError(f"the schema registry returned no schema text for {what}")
    return schema.schema_str


def subject_name(topic: str, is_key: bool) -> str:
    """TopicNameStrategy: ``<topic>-key`` or ``<topic>-value``."""
    return f"{topic}-{'key' if is_key else 'value'}"


class SchemaRegistry(ABC):
    """Schemas by framing header and by subject; registration of derived schemas."""

    framing: Framing

    @abstractmethod
    def resolve(self, header: Header) -> KnownSchema:
        """The writer schema a framing header names (UnknownSchemaError if none)."""

    @abstractmethod
    def versions(self, subject: str) -> list[KnownSchema]:
        """Every known version of ``subject``, oldest first (empty if unknown)."""

    @abstractmethod
    def register(self, subject: str, definition: Mapping[str, Any]) -> KnownSchema:
        """Register ``definition`` under ``subject``; idempotent for an identical schema."""

    def refresh(self) -> None:
        """Look again for schemas added since start (new files)."""
        return

    def listing(self) -> list[KnownSchema] | None:
        """Every schema ``resolve`` can return, as of the last ``refresh``.

        None for a registry that resolves ids it does not list (an HTTP registry): a
        header it has not been asked about may still resolve.
        """
        return None

    def latest(self, subject: str) -> KnownSchema:
        """The newest version of ``subject``."""
        versions = self.versions(subject)
        if not versions:
            raise UnknownSchemaError(f"no schema is registered under subject {subject!r}")
        return versions[-1]


class FileSchemaRegistry(SchemaRegistry):
    """Every ``.avsc`` under some folders, addressed by CRC-64-AVRO fingerprint.

    A file ``<subject>.avsc`` is version 1 of ``<subject>``, ``<subject>.v2.avsc``
    version 2, and so on. Schemas registered at run time are written to ``write_dir``
    (when given) under the same naming, so a consumer without a registry can decode.
    """

    framing = Framing.SINGLE_OBJECT

    def __init__(
        self,
        dirs: Iterable[Path] = (),
        files: Iterable[Path] = (),
        write_dir: Path | None = None,
    ) -> None:
        self._by_fingerprint: dict[bytes, KnownSchema] = {}
        self._by_subject: dict[str, dict[int, KnownSchema]] = {}
        self._write_dir = write_dir
        self._dirs = [*dirs, *([write_dir] if write_dir else [])]
        self._files = list(files)
        self._loaded: set[Path] = set()
        self.refresh()

    def refresh(self) -> None:
        """Load ``.avsc`` files that appeared in the folders since the last look."""
        paths: list[Path] = []
        for folder in self._dirs:
            if folder.is_dir():
                paths.extend(sorted(folder.glob("*.avsc")))
        paths.extend(self._files)
        for path in paths:
            if path not in self._loaded:
                self._add(load_schema_file(path))
                self._loaded.add(path)

    def listing(self) -> list[KnownSchema]:
        """Every schema file loaded: a fingerprint not among them does not resolve."""
        return list(self._by_fingerprint.values())

    def _add(self, known: KnownSchema) -> None:
        self._by_fingerprint.setdefault(known.fingerprint, known)
        if known.subject is not None and known.version is not None:
            self._by_subject.setdefault(known.subject, {})[known.version] = known

    def resolve(self, header: Header) -> KnownSchema:
        """The schema with the header's fingerprint."""
        if header.framing is Framing.CONFLUENT:
            raise UnknownSchemaError(
                f"message names Confluent {header.describe()}, but no schema registry is "
                "configured (schema_registry.url is null)"
            )
        assert header.fingerprint is not None
        try:
            return self._by_fingerprint[header.fingerprint]
        except KeyError:
            raise UnknownSchemaError(
                f"no schema file has {header.describe()} "
                f"({len(self._by_fingerprint)} schemas known)"
            ) from None

    def versions(self, subject: str) -> list[KnownSchema]:
        """Versions of ``subject`` from its files, oldest first."""
        by_version = self._by_subject.get(subject, {})
        return [by_version[v] for v in sorted(by_version)]

    def register(self, subject: str, definition: Mapping[str, Any]) -> KnownSchema:
        """Add ``definition`` as the next version of ``subject`` (and write it out)."""
        candidate = parse_schema(definition)
        for existing in self.versions(subject):
            if existing.fingerprint == candidate.fingerprint:
                return existing
        version = len(self.versions(subject)) + 1
        known = parse_schema(definition, subject=subject, version=version)
        if self._write_dir is not None:
            self._write_dir.mkdir(parents=True, exist_ok=True)
            name = f"{subject}.avsc" if version == 1 else f"{subject}.v{version}.avsc"
            target = self._write_dir / name
            temporary = target.with_suffix(".tmp")
            temporary.write_text(json.dumps(known.definition, indent=2) + "\n")
            temporary.replace(target)
        self._add(known)
        return known


class ConfluentSchemaRegistry(SchemaRegistry):
    """A Confluent-compatible HTTP registry (``confluent_kafka.schema_registry``).

    Single-object messages (fingerprints) still resolve through ``files``, so topics
    written by both kinds of producer can be read.
    """

    framing = Framing.CONFLUENT

    def __init__(
        self,
        url: str,
        options: Mapping[str, str] | None = None,
        files: FileSchemaRegistry | None = None,
    ) -> None:
        # new_client: an HTTP client, or the library's in-memory one for "mock://" URLs.
        self._client = SchemaRegistryClient.new_client({"url": url, **(options or {})})
        self._files = files or FileSchemaRegistry()
        self._by_id: dict[int, KnownSchema] = {}

    @property
    def files(self) -> FileSchemaRegistry:
        """The schema files beside the registry (``schema_registry.dirs``, pinned files)."""
        return self._files

    def refresh(self) -> None:
        """Look again for schema files (single-object framing resolves through them)."""
        self._files.refresh()

    def resolve(self, header: Header) -> KnownSchema:
        """The schema with the header's id (asked once, then cached)."""
        if header.framing is Framing.SINGLE_OBJECT:
            return self._files.resolve(header)
        assert header.schema_id is not None
        known = self._by_id.get(header.schema_id)
        if known is None:
            try:
                schema = self._client.get_schema(header.schema_id)
            except SchemaRegistryError as exc:
                raise UnknownSchemaError(
                    f"the schema registry does not know {header.describe()}: {exc.error_message}"
                ) from None
            known = parse_schema(_text(schema, header.describe()), schema_id=header.schema_id)
            self._by_id[header.schema_id] = known
        return known

    def versions(self, subject: str) -> list[KnownSchema]:
        """Versions of ``subject`` from the registry, oldest first."""
        try:
            numbers = self._client.get_versions(subject)
        except SchemaRegistryError as exc:
            if exc.http_status_code == 404:
                return []
            raise
        versions = []
        for number in sorted(numbers):
            registered = self._client.get_version(subject, number)
            versions.append(
                parse_schema(
                    _text(registered.schema, subject),
                    subject=subject,
                    version=registered.version,
                    schema_id=registered.schema_id,
                )
            )
        return versions

    def latest(self, subject: str) -> KnownSchema:
        """The newest version of ``subject``, in one request."""
        try:
            registered = self._client.get_latest_version(subject)
        except SchemaRegistryError as exc:
            raise UnknownSchemaError(
                f"no schema is registered under subject {subject!r}: {exc.error_message}"
            ) from None
        return parse_schema(
            _text(registered.schema, subject),
            subject=subject,
            version=registered.version,
            schema_id=registered.schema_id,
        )

    def register(self, subject: str, definition: Mapping[str, Any]) -> KnownSchema:
        """Register under ``subject`` (the registry dedupes identical schemas)."""
        text = json.dumps(definition)
        schema_id = self._client.register_schema(subject, Schema(text, "AVRO"))
        known = parse_schema(text, subject=subject, schema_id=schema_id)
        self._by_id.setdefault(schema_id, known)
        return known
