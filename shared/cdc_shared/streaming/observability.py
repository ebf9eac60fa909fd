"""Logs, metrics and health for every service.

Logs are one JSON object per line on stderr. Metrics are Prometheus (``/metrics``) and
health is ``/health`` (200 when every stream runs, 503 otherwise), both on one port.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

BATCHES = Counter("cdc_batches_total", "Micro-batches completed", ["service", "entity"])
ROWS = Counter("cdc_rows_total", "Rows handled, by outcome", ["service", "entity", "outcome"])
INPUT_ROWS = Counter(
    "cdc_input_rows_total", "Rows micro-batches read from their source", ["service", "entity"]
)
BATCH_SECONDS = Histogram(
    "cdc_batch_duration_seconds",
    "Wall time of a micro-batch",
    ["service", "entity"],
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
LAG = Gauge(
    "cdc_lag", "Input not yet processed (Kafka offsets or table versions)", ["service", "entity"]
)
HEALTHY = Gauge("cdc_healthy", "1 while every stream of the service runs", ["service"])

_STANDARD_ATTRIBUTES = set(vars(logging.LogRecord("", 0, "", 0, "", None, None)))


class Stopwatch:
    """Wall time of a batch's steps for its log line: ``{"<step>_ms": n}``.

    Each step is measured from the end of the previous one.
    """

    def __init__(self) -> None:
        self.laps: dict[str, int] = {}
        self._last = time.monotonic()

    def __call__(self, step: str) -> None:
        """Record ``step`` as ending now."""
        now = time.monotonic()
        self.laps[f"{step}_ms"] = int((now - self._last) * 1000)
        self._last = now


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, then any ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        """Render ``record`` as JSON."""
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update({k: v for k, v in vars(record).items() if k not in _STANDARD_ATTRIBUTES})
        if record.exc_info and record.exc_info[0] is not None:
            entry["error"] = f"{record.exc_info[0].__name__}: {record.exc_info[1]}"
        return json.dumps(entry, default=str)


def configure_logging(level: str = "INFO") -> None:
    """JSON lines on stderr for the whole process; libraries' chatter kept quiet.

    py4j logs every gateway call, the HTTP clients (the schema registry's, and
    Elasticsearch's transport) every request at INFO: only their warnings are kept.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for chatty in ("py4j", "httpx", "httpx2", "httpcore", "elastic_transport"):
        logging.getLogger(chatty).setLevel(logging.WARNING)


class HealthServer:
    """Serves ``/metrics`` and ``/health`` on a background thread."""

    def __init__(self, host: str, port: int, health: Callable[[], dict[str, Any]]) -> None:
        check = health

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.startswith("/metrics"):
                    body, status, kind = generate_latest(), 200, CONTENT_TYPE_LATEST
                elif self.path.startswith("/health"):
                    report = check()
                    status = 200 if report.get("status") == "ok" else 503
                    body, kind = json.dumps(report).encode(), "application/json"
                else:
                    body, status, kind = b"not found\n", 404, "text/plain"
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return  # probes every few seconds would flood the log

        self._server = ThreadingHTTPServer((host, port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> HealthServer:
        """Start serving."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and free the port."""
        self._server.shutdown()
        self._server.server_close()
