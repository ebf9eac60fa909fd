"""``cdc run``: the chosen services as streaming queries of one Spark application.

Small deployments (a laptop, one VM, docker-compose, CI) pay for four JVMs, four heaps
and four JIT warm-ups on cores they do not have. Here the services share one driver and
one Delta snapshot cache, and nothing else: each keeps its own code, streams,
checkpoints, tables and quarantine, and talks to the others only through Delta tables.
Checkpoint and table paths are the same as in separate processes, so a service can move
to its own deployment (``cdc-<service>``) and back with nothing to migrate.

Spark's FAIR scheduler gives each service a pool (weights: ``application.pool_weights``);
one ``/health`` and ``/metrics`` endpoint reports every service; one SIGTERM drains every
query. A failing entity stops only its own stream, as in a service of its own; a service
that fails as a whole stops the application (exit 1) so that its supervisor restarts it.
"""

from __future__ import annotations

import functools
import logging
import signal
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Protocol
from xml.sax.saxutils import quoteattr

from cdc_ingestor.main import start as ingestor
from cdc_merger.main import start as merger
from cdc_publisher_es.main import start as publisher_es
from cdc_publisher_kafka.main import start as publisher_kafka
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.config.services import SparkConfig
from cdc_shared.config.values import ConfigError
from cdc_shared.contracts.layout import (
    INGESTOR,
    MERGER,
    PUBLISHER_ES,
    PUBLISHER_KAFKA,
    SERVICE_NAMES,
    SERVICES,
    display_name,
    section_name,
)
from cdc_shared.jvm.spark import (
    build_spark_session,
    side_by_side,
    with_sized_heap,
)
from cdc_shared.streaming.failures import StreamFailedError
from cdc_shared.streaming.observability import HealthServer
from cdc_shared.streaming.runner import StreamRunner
from cdc_shared.streaming.service import run_to_exit_code
from cdc_shared.streaming.writer_lease import refuse_if_running
from pyspark import InheritableThread
from pyspark.sql import SparkSession

APPLICATION = "application"  # how logs and exit messages name ``cdc run``
log = logging.getLogger(f"cdc_{APPLICATION}")

#: A service's ``start``: (config, --entity names, --once, the session, group_names=...).
StartService = Callable[..., StreamRunner]
POOL_PROPERTY = "spark.scheduler.pool"


def _starts() -> dict[str, StartService]:
    """Each service's ``start`` (imported here: a service's import pulls in its libraries)."""
    return {
        display_name(INGESTOR): ingestor,
        display_name(MERGER): merger,
        display_name(PUBLISHER_KAFKA): publisher_kafka,
        display_name(PUBLISHER_ES): publisher_es,
    }


def select_services(names: list[str] | None) -> list[str]:
    """The services to run, in pipeline order: ``names`` (either spelling), else all four."""
    if not names:
        return list(SERVICE_NAMES)
    chosen = {display_name(name) for name in names}
    unknown = sorted(chosen - set(SERVICE_NAMES))
    if unknown:
        raise ConfigError(f"unknown services {unknown}; known: {', '.join(SERVICE_NAMES)}")
    return [s for s in SERVICE_NAMES if s in chosen]


def fair_scheduler_conf(
    config: PipelineConfig, services: list[str], directory: Path
) -> dict[str, str]:
    """Spark settings for one FAIR pool per service, weighted (the file goes in ``directory``)."""
    pools = "\n".join(
        f"  <pool name={quoteattr(s)}><schedulingMode>FIFO</schedulingMode>"
        f"<weight>{config.application.weight(s)}</weight><minShare>0</minShare></pool>"
        for s in services
    )
    allocation = directory / "fairscheduler.xml"
    allocation.write_text(f'<?xml version="1.0"?>\n<allocations>\n{pools}\n</allocations>\n')
    return {"spark.scheduler.mode": "FAIR", "spark.scheduler.allocation.file": str(allocation)}


def without_service_endpoints(config: PipelineConfig) -> PipelineConfig:
    """The configuration with every service's own metrics server off (the app serves one)."""
    return config.model_copy(
        update={s: getattr(config, s).model_copy(update={"metrics_port": 0}) for s in SERVICES}
    )


class Application:
    """Several services' streams in one SparkSession; ``start`` then ``run``."""

    def __init__(
        self,
        config: PipelineConfig,
        services: list[str],
        entity_names: list[str] | None = None,
        once: bool = False,
        spark: SparkSession | None = None,
        group_names: list[str] | None = None,
    ) -> None:
        self.config = config
        self.services = services
        self.entity_names = entity_names
        self.group_names = group_names
        self.once = once
        self.runners: dict[str, StreamRunner] = {}
        self._stop = threading.Event()
        self._failures: dict[str, str] = {}
        self._server: HealthServer | None = None
        self._scratch = tempfile.TemporaryDirectory(prefix="cdc-run-")
        self._spark = spark

    @property
    def spark(self) -> SparkSession:
        """The application's SparkSession: the one given, or one with the FAIR pools."""
        if self._spark is None:
            self._spark = self._session()
        return self._spark

    def _session(self) -> SparkSession:
        return build_spark_session(self.spark_config(), "cdc")

    def spark_config(self) -> SparkConfig:
        """FAIR pools and a heap sized for the tables, unless ``spark.conf`` says otherwise."""
        fair = fair_scheduler_conf(self.config, self.services, Path(self._scratch.name))
        tables = len(self.config.select_entities(self.entity_names))
        spark = with_sized_heap(self.config.spark, tables * len(self.services))
        return spark.model_copy(update={"conf": {**fair, **spark.conf}})

    def serve(self) -> None:
        """Serve ``/health`` and ``/metrics`` for every service (unless the port is 0).

        Bound before Spark starts, so no port Spark picks can take it; until the services
        run, ``/health`` answers 503 "starting".
        """
        settings = self.config.application
        if settings.metrics_port:
            self._server = HealthServer(
                settings.metrics_host, settings.metrics_port, self.health
            ).start()
            log.info("serving /metrics and /health", extra={"port": self._server.port})

    def start(self, service: str) -> StreamRunner:
        """Start one service's streams, its Spark jobs in the service's own pool."""
        # Stream threads inherit the starting thread's local properties, and so do the
        # jobs their foreachBatch functions run.
        self.spark.sparkContext.setLocalProperty(POOL_PROPERTY, service)
        try:
            runner = _starts()[service](
                without_service_endpoints(self.config),
                self.entity_names,
                self.once,
                self.spark,
                group_names=self.group_names,
            )
        finally:
            self.spark.sparkContext.setLocalProperty(POOL_PROPERTY, None)  # type: ignore[arg-type]
        self.adopt(service, runner)
        return runner

    def start_side_by_side(self) -> None:
        """Start every service, each in a thread of its own; raise the first failure.

        A start is mostly waiting: on Delta tables made or checked, on Kafka and
        Elasticsearch, on its source table. Side by side, a restart of the application
        takes about as long as its slowest service's start, not the sum of all four.
        """
        if self._spark is None:  # made once, before the threads, as are the imports
            self._spark = self._session()
        _starts()

        def start(service: str) -> None:
            if self._stop.is_set():
                return
            try:
                self.start(service)
            except BaseException:
                self.request_stop()  # the others stop as soon as they have started
                raise

        side_by_side([functools.partial(start, service) for service in self.services])

    def adopt(self, service: str, runner: StreamRunner) -> None:
        """Count a started service in: health, stop requests (one that came while it started)."""
        self.runners[service] = runner
        if self._stop.is_set():  # SIGTERM came while it started: it stops with the others
            runner.request_stop()

    def health(self) -> dict[str, Any]:
        """Every service's ``/health`` report; ok when every service is."""
        reports = {name: runner.health() for name, runner in list(self.runners.items())}
        for name in self.services:
            reports.setdefault(name, {"status": "starting", "streams": {}})
        ok = all(r["status"] == "ok" for r in reports.values()) and not self._failures
        return {"status": "ok" if ok else "failing", "services": reports}

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT drain every service's queries (after the batches in flight)."""

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            log.info("stop requested", extra={"service": APPLICATION, "signal": signum})
            self.request_stop()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def request_stop(self) -> None:
        """Ask every running service to stop after its micro-batches in flight."""
        self._stop.set()
        for runner in list(self.runners.values()):
            runner.request_stop()

    def run(self) -> None:
        """Start and run the services until done (``--once``) or stopped.

        Continuous: all start at once (each waits for its source table, as it would in a
        process of its own), then run side by side. ``--once``: one after another, each
        to the end of what its source holds, so one call carries what is in Kafka through
        to the outputs.
        Raises StreamFailedError naming every service that failed (``supervise``).
        """
        self.serve()
        try:
            if self.once:
                for service in self.services:
                    if self._stop.is_set():
                        break
                    self.supervise([self.start(service)])
            else:
                self.start_side_by_side()
                self.supervise([self.runners[s] for s in self.services if s in self.runners])
        except BaseException:
            for runner in self.runners.values():
                runner.stop_now()
            raise
        finally:
            if self._server is not None:
                self._server.stop()
            self._scratch.cleanup()

    def supervise(self, runners: Sequence[Supervised]) -> None:
        """Run the runners side by side until all end; the first to fail stops the others.

        Raises StreamFailedError naming every service that failed.
        """

        def run(runner: Supervised) -> None:
            self.spark.sparkContext.setLocalProperty(POOL_PROPERTY, _pool(runner))  # restarts
            try:
                runner.run()
            except StreamFailedError as error:
                self._failures[runner.service] = str(error)
                log.error("%s", error, extra={"service": runner.service})
                self.request_stop()
            except Exception as error:
                self._failures[runner.service] = f"{runner.service} failed: {error!r}"
                log.exception("service failed", extra={"service": runner.service})
                self.request_stop()

        threads = [
            InheritableThread(target=run, args=(r,), name=f"run-{r.service}") for r in runners
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                thread.join(0.5)  # the main thread stays free to take signals
        if self._failures:
            raise StreamFailedError("; ".join(self._failures.values()))


class Supervised(Protocol):
    """What ``Application.supervise`` needs of a service's runner (a ``StreamRunner``)."""

    service: str

    def run(self) -> None:
        """Run until done or stopped; StreamFailedError when the service failed."""

    def request_stop(self) -> None:
        """Stop after the micro-batches in flight."""


def _pool(runner: Supervised) -> str:
    """The pool of a runner's service (runners name services with underscores)."""
    return display_name(runner.service)


def run_application(
    config_path: str | None,
    services: list[str] | None = None,
    entity_names: list[str] | None = None,
    once: bool = False,
    group_names: list[str] | None = None,
) -> int:
    """``cdc run``: load the configuration, run the services until done or SIGTERM.

    Exit codes as for a service alone (``run_to_exit_code``): 0 done or stopped, 1 a
    service failed, 2 bad configuration or schemas.
    """

    def run(config: PipelineConfig) -> None:
        chosen = select_services(services)
        entities = config.select_entities(entity_names)  # unknown names fail here
        # Each service takes its writer leases as it starts; an instance already
        # writing any of them is named before anything runs (``--once`` starts late ones).
        application = Application(config, chosen, entity_names, once, group_names=group_names)
        refuse_if_running(
            config.storage_root,
            [section_name(s) for s in chosen],
            [e.name for e in entities],
            None if "://" not in config.storage_root else application.spark,  # S3: read by it
        )
        application.install_signal_handlers()
        log.info("starting", extra={"service": APPLICATION, "services": chosen, "once": once})
        application.run()

    return run_to_exit_code(APPLICATION, config_path, run)
