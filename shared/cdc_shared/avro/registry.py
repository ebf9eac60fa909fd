"""Where writer and reader schemas come from: .avsc files, or a Confluent-compatible registry.

Both registries answer the same questions: which schema does this framing header name,
which is the newest schema of a subject (``<topic>-key`` / ``<topic>-value``, the
TopicNameStrategy), and register a schema derived at run time. Parsed schemas are cached.

An HTTP registry tells two failures apart: "no such schema" (404 with a registry error
code) is the record's fault (``UnknownSchemaError``: quarantine), anything else is the
registry's (retried, then ``SchemaRegistryUnavailableError``: the caller stops).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import fastavro
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient, SchemaRegistryError

# The HTTP library the registry client uses (httpx2, else httpx): its TransportError is
# how the client reports a request that got no answer (refused, reset, timed out).
from confluent_kafka.schema_registry.common._httpx_compat import httpx
from fastavro.schema import fingerprint as _fingerprint
from fastavro.schema import to_parsing_canonical_form

from cdc_shared.avro.errors import SchemaRegistryUnavailableError, UnknownSchemaError
from cdc_shared.avro.framing import (
    Framing,
    Header,
    confluent_header,
    single_object_header,
)
from cdc_shared.clients.retry import retrying

_VERSIONED_FILE = re.compile(r"^(?P<subject>.+?)(?:\.v(?P<version>\d+))?\.avsc$")
#: Backoff between retries of a registry request (cdc_shared.clients.retry's policy).
_INITIAL_BACKOFF_S = 0.5
_MAX_BACKOFF_S = 15.0
#: Answers worth asking again: the registry is down or overloaded, or refuses credentials
#: that may be fixed (rotated, a token re-issued) while we wait.
_RETRIED_STATUSES = frozenset({401, 403, 408, 429})

log = logging.getLogger("cdc_shared.avro")
_T = TypeVar("_T")


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


def _without_credentials(url: str) -> str:
    """``url`` (one or several, comma-separated) without any ``user:password@``."""
    shown = []
    for one in url.split(","):
        parts = urlsplit(one.strip())
        host = parts.netloc.rpartition("@")[2]
        shown.append(urlunsplit(parts._replace(netloc=host)))
    return ",".join(shown)


def _is_unknown(error: SchemaRegistryError) -> bool:
    """The registry's own "not found" (404 with a 404xx error code), not a proxy's 404."""
    return error.http_status_code == 404 and error.error_code // 100 == 404


def _is_registry_fault(error: BaseException) -> bool:
    """Whether asking again may help: no answer, or a 5xx, 401/403, 408 or 429 answer."""
    if isinstance(error, httpx.TransportError):
        return True
    if isinstance(error, SchemaRegistryError):
        return error.http_status_code >= 500 or error.http_status_code in _RETRIED_STATUSES
    return False


def _problem(error: BaseException) -> str:
    """What the registry did, for a message: the status and its text, or the lost request."""
    if isinstance(error, SchemaRegistryError):
        return f"answered HTTP {error.http_status_code} ({error.error_message})"
    return f"did not answer ({type(error).__name__}: {error})"


class ConfluentSchemaRegistry(SchemaRegistry):
    """A Confluent-compatible HTTP registry (``confluent_kafka.schema_registry``).

    Single-object messages (fingerprints) still resolve through ``files``, so topics
    written by both kinds of producer can be read. A request the registry fails to answer
    is retried with backoff (``cdc_shared.clients.retry``; the client's own retries are off, so
    there is one policy) for about ``retry_budget_s``, each try warned in the log, then
    raises :class:`SchemaRegistryUnavailableError`; each request gives up waiting for an
    answer after ``request_timeout_s``. The defaults are ``SchemaRegistryConfig``'s.
    """

    framing = Framing.CONFLUENT

    def __init__(
        self,
        url: str,
        options: Mapping[str, str] | None = None,
        files: FileSchemaRegistry | None = None,
        *,
        retry_budget_s: float = 180.0,
        request_timeout_s: float = 30.0,
    ) -> None:
        # new_client: an HTTP client, or the library's in-memory one for "mock://" URLs.
        self._client = SchemaRegistryClient.new_client(
            {"url": url, "timeout": request_timeout_s, **(options or {}), "max.retries": 0}
        )
        self._files = files or FileSchemaRegistry()
        self._by_id: dict[int, KnownSchema] = {}
        self.url = _without_credentials(url)
        self.retry_budget_s = retry_budget_s

    @property
    def files(self) -> FileSchemaRegistry:
        """The schema files beside the registry (``schema_registry.dirs``, pinned files)."""
        return self._files

    def refresh(self) -> None:
        """Look again for schema files (single-object framing resolves through them)."""
        self._files.refresh()

    def _ask(self, what: str, request: Callable[[], _T]) -> _T:
        """``request``'s answer, asking again while the registry fails and the budget lasts.

        A registry error that asking again cannot mend (e.g. 404, 409) is raised as it is,
        for the caller to read; a fault still there when the budget is spent is raised as
        :class:`SchemaRegistryUnavailableError` naming the registry, ``what`` was asked,
        and the registry's last answer.
        """
        deadline = time.monotonic() + self.retry_budget_s
        policy = retrying(
            lambda error: _is_registry_fault(error) and time.monotonic() < deadline,
            initial_s=_INITIAL_BACKOFF_S,
            max_s=_MAX_BACKOFF_S,
            attempts=None,
            log=log,
            describe=lambda error, attempt: (
                f"the schema registry {_problem(error)} when asked for {what}; retrying"
            ),
            fields={"registry": self.url},
        )
        attempts = 0

        def counted() -> _T:
            nonlocal attempts
            attempts += 1
            return request()

        try:
            return policy(counted)
        except Exception as error:
            if not _is_registry_fault(error):
                raise
            raise SchemaRegistryUnavailableError(
                f"the schema registry at {self.url} {_problem(error)} when asked for {what}, "
                f"{attempts} time(s) over {self.retry_budget_s:g} s "
                "(schema_registry.retry_budget_s). No record was quarantined for it: the "
                "stream stops, and resumes from its checkpoint once restarted. Check that "
                "the registry is up and reachable from here, and for HTTP 401/403 the "
                "credentials in schema_registry.options"
            ) from None

    def _unexpected(self, error: SchemaRegistryError, what: str) -> SchemaRegistryUnavailableError:
        """A registry answer that is neither the schema nor "not found" (e.g. HTTP 400)."""
        return SchemaRegistryUnavailableError(
            f"the schema registry at {self.url} {_problem(error)} when asked for {what}: an "
            "answer no retry mends. Check that schema_registry.url is the registry's "
            "Confluent-compatible API; no record was quarantined for it"
        )

    def resolve(self, header: Header) -> KnownSchema:
        """The schema with the header's id (asked once, then cached).

        UnknownSchemaError only when the registry says it has no such id; a registry that
        cannot answer raises SchemaRegistryUnavailableError (after retries).
        """
        if header.framing is Framing.SINGLE_OBJECT:
            return self._files.resolve(header)
        assert header.schema_id is not None
        schema_id = header.schema_id
        known = self._by_id.get(schema_id)
        if known is None:
            what = header.describe()
            try:
                schema = self._ask(what, lambda: self._client.get_schema(schema_id))
            except SchemaRegistryError as exc:
                if _is_unknown(exc):
                    raise UnknownSchemaError(
                        f"the schema registry at {self.url} does not know {what}: "
                        f"{exc.error_message}"
                    ) from None
                raise self._unexpected(exc, what) from None
            known = parse_schema(_text(schema, what), schema_id=schema_id)
            self._by_id[schema_id] = known
        return known

    def versions(self, subject: str) -> list[KnownSchema]:
        """Versions of ``subject`` from the registry, oldest first (empty if it has none)."""
        what = f"the versions of subject {subject!r}"
        try:
            numbers = self._ask(what, lambda: self._client.get_versions(subject))
            versions = []
            for number in sorted(numbers):
                registered = self._ask(
                    f"version {number} of subject {subject!r}",
                    functools.partial(self._client.get_version, subject, number),
                )
                versions.append(
                    parse_schema(
                        _text(registered.schema, subject),
                        subject=subject,
                        version=registered.version,
                        schema_id=registered.schema_id,
                    )
                )
        except SchemaRegistryError as exc:
            if _is_unknown(exc):
                return []
            raise self._unexpected(exc, what) from None
        return versions

    def latest(self, subject: str) -> KnownSchema:
        """The newest version of ``subject``, in one request."""
        what = f"the latest version of subject {subject!r}"
        try:
            registered = self._ask(what, lambda: self._client.get_latest_version(subject))
        except SchemaRegistryError as exc:
            if _is_unknown(exc):
                raise UnknownSchemaError(
                    f"no schema is registered under subject {subject!r}: {exc.error_message}"
                ) from None
            raise self._unexpected(exc, what) from None
        return parse_schema(
            _text(registered.schema, subject),
            subject=subject,
            version=registered.version,
            schema_id=registered.schema_id,
        )

    def register(self, subject: str, definition: Mapping[str, Any]) -> KnownSchema:
        """Register under ``subject`` (the registry dedupes identical schemas).

        The registry's refusal (e.g. 409, an incompatible schema) is raised as its
        ``SchemaRegistryError``; a registry that cannot answer is retried.
        """
        text = json.dumps(definition)
        schema_id = self._ask(
            f"registering a schema under subject {subject!r}",
            lambda: self._client.register_schema(subject, Schema(text, "AVRO")),
        )
        known = parse_schema(text, subject=subject, schema_id=schema_id)
        self._by_id.setdefault(schema_id, known)
        return known
