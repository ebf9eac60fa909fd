"""A switchable HTTP proxy on loopback in front of the real schema registry.

It forwards every request to the registry as it is, until told to fail: answer HTTP 503
(the registry down or overloaded behind a load balancer), answer 401 (credentials
refused), or close each connection without an answer (a registry that crashes mid
request). So the services' handling of registry faults is met with the real registry's
answers, only the fault being staged: the registry-outage tests stage one fault each,
``cdc chaos --registry-outages`` stages outages while the whole pipeline runs.
"""

from __future__ import annotations

import http.client
import json
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal
from urllib.parse import urlsplit

Mode = Literal["forward", "503", "401", "close"]
#: Headers the proxy does not pass on (hop-by-hop, or recomputed by http.client).
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "host", "content-length"}


class RegistryProxy:
    """``url`` reaches the registry at ``upstream`` through the proxy; ``mode`` says how.

    ``requests`` counts the requests seen in each mode, to tell a retried request from
    one asked once (and an outage some service met from one nobody noticed).
    """

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        if parts.hostname is None or parts.port is None:
            raise ValueError(
                f"the registry proxy needs an upstream URL with a host and a port, got {upstream!r}"
            )
        self.upstream_host, self.upstream_port = parts.hostname, parts.port
        self.mode: Mode = "forward"
        self._left: int | None = None  # answers left in ``mode`` before healing
        self.requests: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_port}{parts.path}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> RegistryProxy:
        """Serve on a free loopback port (``url``), in a background thread."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and free the port."""
        self._server.shutdown()
        self._server.server_close()

    def fail(self, mode: Mode, answers: int | None = None) -> None:
        """Answer requests as ``mode`` says; ``forward`` heals.

        All requests from now on, or the next ``answers`` only, then heal by itself (an
        outage that ends mid-retry).
        """
        with self._lock:
            self.mode = mode
            self._left = answers

    def _seen(self) -> Mode:
        with self._lock:
            mode = self.mode
            self.requests[mode] += 1
            if self._left is not None:
                self._left -= 1
                if self._left <= 0:
                    self.mode, self._left = "forward", None
            return mode

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                mode = proxy._seen()
                if mode == "close":
                    self.close_connection = True
                    return
                if mode in ("503", "401"):
                    status = int(mode)
                    text = json.dumps({"error_code": status, "message": f"staged {status}"})
                    self._reply(status, [("Content-Type", "application/json")], text.encode())
                    return
                upstream = http.client.HTTPConnection(
                    proxy.upstream_host, proxy.upstream_port, timeout=30
                )
                try:
                    headers = {
                        k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP
                    }
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    answer = upstream.getresponse()
                    content = answer.read()
                    passed = [
                        (k, v) for k, v in answer.getheaders() if k.lower() not in _HOP_BY_HOP
                    ]
                    self._reply(answer.status, passed, content)
                finally:
                    upstream.close()

            def _reply(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
                self.send_response(status)
                for key, value in headers:
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_DELETE = _answer

            def log_message(self, format: str, *args: object) -> None:
                return  # quiet: the callers' own counts and assertions say what happened

        return Handler


@contextmanager
def registry_proxy(upstream: str) -> Iterator[RegistryProxy]:
    """A :class:`RegistryProxy` to ``upstream``, serving for the ``with`` block."""
    proxy = RegistryProxy(upstream).start()
    try:
        yield proxy
    finally:
        proxy.stop()
