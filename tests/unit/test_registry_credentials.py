"""The schema registry's credentials on the wire, against an HTTP server that checks them.

The registry the integration tests run (Apicurio, in memory) cannot check credentials
without an identity server: its basic auth is OIDC client credentials exchanged at a token
endpoint. So a small Confluent-compatible server on loopback stands in for one that
requires HTTP basic auth: the pipeline's ``schema_registry.options`` reach it as the
Authorization header, and a refused password fails with the registry's status, never the
password.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from cdc_shared.avro.registry import ConfluentSchemaRegistry, SchemaRegistryUnavailableError

USER, PASSWORD = "cdc-reader", "registry-secret-4711"
SCHEMA = {"type": "record", "name": "Key", "fields": [{"name": "id", "type": "int"}]}


class _Registry(BaseHTTPRequestHandler):
    """Answers the latest version of any subject to the right credentials, else 401."""

    def do_GET(self) -> None:
        expected = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
        if self.headers.get("Authorization") != expected:
            self._answer(401, {"error_code": 401, "message": "Unauthorized"})
            return
        subject = self.path.split("/")[2]
        body = {"subject": subject, "id": 7, "version": 1, "schema": json.dumps(SCHEMA)}
        self._answer(200, body)

    def _answer(self, status: int, body: dict[str, object]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the test reads the client's side."""


@pytest.fixture
def registry_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Registry)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _options(password: str) -> dict[str, str]:
    """``schema_registry.options`` as docs/configuration.md shows them."""
    return {"basic.auth.user.info": f"{USER}:{password}"}


def test_basic_auth_from_the_options_reaches_the_registry(registry_url: str) -> None:
    registry = ConfluentSchemaRegistry(registry_url, _options(PASSWORD), retry_budget_s=1)
    known = registry.latest("orders-key")
    assert (known.schema_id, known.version) == (7, 1)


def test_a_refused_password_names_the_status_never_the_password(registry_url: str) -> None:
    wrong = "wrong-" + PASSWORD
    registry = ConfluentSchemaRegistry(registry_url, _options(wrong), retry_budget_s=0.5)
    with pytest.raises(SchemaRegistryUnavailableError) as refused:
        registry.latest("orders-key")
    message = str(refused.value)
    assert "HTTP 401" in message and "credentials in schema_registry.options" in message
    assert wrong not in message and PASSWORD not in message
