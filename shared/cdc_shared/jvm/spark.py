"""The SparkSession every service and test uses: Delta, the Kafka connector and Avro."""

from __future__ import annotations

import gc
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pyspark import InheritableThread, StorageLevel
from pyspark.sql import Column, DataFrame, Observation, SparkSession
from pyspark.sql import functions as F

from cdc_shared.config.services import SparkConfig
from cdc_shared.jvm import artifacts as jvm
from cdc_shared.jvm import bridge as jvm_bridge

log = logging.getLogger(__name__)

DELTA_EXTENSION = "io.delta.sql.DeltaSparkSessionExtension"
DELTA_CATALOG = "org.apache.spark.sql.delta.catalog.DeltaCatalog"
DRIVER_JAVA_OPTIONS = "spark.driver.extraJavaOptions"

#: The garbage collector of a local driver (which runs the tasks too). The JVM's default
#: on two cores, G1, spent a sixth of a merger batch's CPU in its concurrent and
#: collection threads; the parallel collector does the same work with about a third of
#: that and no concurrent threads (docs/benchmarks.md, "JVM threads").
LOCAL_DRIVER_GC = "-XX:+UseParallelGC"
_NAMES_A_COLLECTOR = re.compile(r"-XX:[+-]Use\w*GC\b")
#: The most that collector's young generation takes. To collect less often it grows the
#: young generation toward a third of the heap, and a heap sized for hundreds of queries
#: (``driver_memory``) then holds gigabytes of garbage between collections; capped, a
#: small heap is unchanged (a third of 1 GiB is below it) and a large one only grows its
#: old generation as live data needs it (docs/benchmarks.md, "young generation").
LOCAL_DRIVER_YOUNG = "-XX:MaxNewSize=512m"
_SIZES_THE_YOUNG_GENERATION = re.compile(r"-Xmn\d|-XX:(Max)?NewSize=|-XX:NewRatio=")
#: The driver JVM's default time zone. Spark's session zone is UTC already; a JVM whose
#: default zone is another makes Delta check each commit's incrementally computed file
#: list by rebuilding the table's state (``allFilesInCrc`` verification, forced outside
#: UTC): three more Spark jobs per commit of every table (docs/benchmarks.md).
DRIVER_TIME_ZONE = "-Duser.timezone=UTC"
#: The driver's logging (``log4j2.properties`` beside this module): the JVM's warnings and
#: errors as JSON lines, without what repeats a failure the services report themselves.
JVM_LOGGING = Path(__file__).with_name("log4j2.properties")
_NAMES_A_LOGGING_FILE = re.compile(r"-Dlog4j2?\.configurationFile=")

#: Spark's setting for the data source options it masks in plans, the SQL tab of its UI
#: and event logs (keys or values matching it; ``spark.redaction.regex`` applies too).
OPTIONS_REDACTION = "spark.sql.redaction.options.regex"
#: Spark's default (``url``), plus the Kafka client's secrets that Spark's other pattern
#: misses by name: the JAAS line (its password) and a PEM key store's private key
#: (``kafka.ssl.keystore.key``, see :func:`cdc_shared.clients.connect.java_security`).
OPTIONS_REDACTION_PATTERN = r"(?i)url|sasl\.jaas\.config|ssl\.keystore\.key|ssl\.key\.password"

#: Our setting (not Spark's) for how often, in seconds, the driver's Python process
#: collects its cyclic garbage; ``0`` leaves it to Python. See :func:`collect_python_garbage`.
PYTHON_GC_INTERVAL = "spark.cdc.python.gcIntervalSeconds"
#: PySpark's recording of each column function's Python call site (for error context).
DATAFRAME_DEBUGGING = "spark.python.sql.dataFrameDebugging.enabled"
#: The driver's heap when ``spark.conf`` sets none: Spark's own default (1 GiB) up to a
#: few dozen tables, then a share per table stream (a table of a service: a service
#: alone has one per table, ``cdc run`` one per table and service), for what the driver
#: keeps of each table (its Delta snapshots, decoders and progress); the figures behind
#: the constants are in docs/benchmarks.md ("driver heap").
DRIVER_MEMORY = "spark.driver.memory"
BASE_HEAP_MIB = 512
HEAP_PER_TABLE_STREAM_MIB = 3
MIN_HEAP_MIB = 1024
_collector_lock = threading.Lock()
_collectors: list[threading.Thread] = []  # the one collector thread, once started


def spark_conf(config: SparkConfig, app_name: str) -> dict[str, str]:
    """The Spark configuration for ``config``: project defaults, then the user's ``conf``.

    Jars come from the JVM cache (``make jvm``); when it is empty, the same artifacts are
    named in ``spark.jars.packages`` for Spark to download, which needs Maven Central.
    The storage root's Hadoop settings (``object_storage``: S3A endpoint, credentials)
    become ``spark.hadoop.*`` entries, which executors receive too; Spark's own
    ``spark.redaction.regex`` hides the secret ones in its UI and event logs, and
    ``OPTIONS_REDACTION`` the Kafka secrets among the source options in plans. The driver
    starts with the class archive of ``make jvm`` when there is one (see
    :mod:`cdc_shared.jvm.class_archive`) and, on a local master, the parallel garbage
    collector (``LOCAL_DRIVER_GC``) with its young generation capped
    (``LOCAL_DRIVER_YOUNG``). Spark's UI is off unless ``conf`` sets
    ``spark.ui.enabled``: it would listen on every interface.

    On a cluster (any master but ``local...``) the driver serves ``spark.jars`` to its
    executors, so workers need no copy of the cache; the executors' size
    (``spark.executor.memory``, ``spark.executor.cores``, ``spark.cores.max``) comes from
    ``conf``. Without ``spark.cores.max`` a standalone master gives an application every
    free core, and the next service's application waits: a warning says so.
    """
    local = config.master.startswith("local")
    conf: dict[str, str] = {
        "spark.app.name": app_name,
        "spark.master": config.master,
        "spark.sql.extensions": DELTA_EXTENSION,
        "spark.sql.catalog.spark_catalog": DELTA_CATALOG,
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.shuffle.partitions": "4" if local else "200",
        # Delta rebuilds table state (e.g. to check txnAppId) with this many tasks: the
        # default of 50 costs seconds per small write on a laptop.
        "spark.databricks.delta.snapshotPartitions": "4" if local else "50",
        "spark.sql.streaming.stopGracefullyOnShutdown": "true",
        # Auto compaction (tables with delta.autoOptimize.autoCompact): once 20 files under
        # 4 MiB have gathered, a commit bins them together; the table then stays under
        # the 50 files Delta keeps in its checksum file, so no commit replays the log.
        "spark.databricks.delta.autoCompact.minNumFiles": "20",
        "spark.databricks.delta.autoCompact.minFileSize": str(4 * 2**20),
        # The merger's MERGE source is a local checkpoint already: Delta's own copy of it
        # ("auto") would be a second one.
        "spark.databricks.delta.merge.materializeSource": "none",
        "spark.databricks.delta.schema.autoMerge.enabled": "false",
        # Spark's UI (driver port 4040) has no bind-address setting: on, it listens on
        # every interface. Off unless the pipeline's spark.conf turns it on; nothing in
        # the services reads it (their state is on /health and /metrics).
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        # Spark keeps 100 compiled classes by default; the services' queries (and Delta's
        # own, per commit) need a few hundred, so with fewer the same classes are
        # compiled again every batch: ~2 of every 3 compilations in a one-application
        # run, each tens of milliseconds.
        "spark.sql.codegen.cache.maxEntries": "1000",
        # PySpark records the Python call site of every column function for error
        # messages: a Python stack walk and five Py4J calls each, most of the time a
        # service spends building an ingestor's decoding or a batch's plan.
        DATAFRAME_DEBUGGING: "false",
        # A kill while a query writes its first offset leaves only a hidden temp file in
        # `offsets/`; Spark's check that a new query's checkpoint is empty counts that
        # file and refuses every restart. Each (service, entity) has its own checkpoint
        # path, so the check guards against nothing here.
        "spark.sql.streaming.verifyCheckpointDirectoryEmptyOnStart": "false",
        # Each query keeps its recent progress reports twice (the query, the UI's store);
        # nothing here reads more than the last, and with four queries per table the
        # default of 100 each grows with every table.
        "spark.sql.streaming.numRecentProgressUpdates": "20",
        "spark.sql.streaming.ui.retainedProgressUpdates": "20",
        # Spark's status store (kept with the UI off: the job counts in the batch logs
        # read it) holds the last 1,000 SQL executions with their plans, 1,000 stages
        # and 100,000 tasks by default; with 100 tables changing, four services run
        # thousands of jobs a minute, and a run at the default heap ended in
        # "GC overhead limit exceeded" inside the store's listener (docs/benchmarks.md).
        "spark.sql.ui.retainedExecutions": "100",
        "spark.ui.retainedStages": "200",
        "spark.ui.retainedTasks": "10000",
        # Every Java object Python used (each batch's DataFrames and their plans) stays
        # in the driver's heap until Python's cyclic collector frees its proxy, which
        # Python runs rarely (see collect_python_garbage).
        PYTHON_GC_INTERVAL: "10",
        OPTIONS_REDACTION: OPTIONS_REDACTION_PATTERN,
    }
    jars = jvm.spark_jars()
    if jars:
        conf["spark.jars"] = ",".join(str(j) for j in jars)
    else:
        log.warning(
            "JVM cache %s is empty; asking Spark to download %s (run `make jvm` to avoid this)",
            jvm.jvm_cache_dir(),
            ", ".join(jvm.SPARK_PACKAGES),
        )
        conf["spark.jars.packages"] = ",".join(jvm.SPARK_PACKAGES)
    conf.update({f"spark.hadoop.{k}": v for k, v in config.hadoop_options().items()})
    conf.update(config.conf)
    conf.update(_driver_java_options(conf.get(DRIVER_JAVA_OPTIONS, ""), local))
    if config.master.startswith("spark://") and "spark.cores.max" not in conf:
        log.warning(
            "%s takes every free core of the standalone cluster %s; set spark.cores.max in "
            "spark.conf so that the other services' applications get cores too",
            app_name,
            config.master,
        )
    return conf


def _driver_java_options(options: str, local: bool) -> dict[str, str]:
    """The driver's JVM options: archive, UTC, logging, a local collector, then the user's.

    The class archive, the UTC time zone, our logging file, a local driver's collector. The
    user's ``options`` come last, so that they win (a time zone of theirs too); a
    collector of theirs replaces ours, since the JVM refuses two, and then its young
    generation is theirs to size too, as it is when they size it themselves; a logging
    file of theirs replaces ours.
    """
    ours = []
    archive = jvm.class_archive()
    if archive.is_file():
        ours.append(f"-XX:SharedArchiveFile={archive}")
    ours.append(DRIVER_TIME_ZONE)
    if not _NAMES_A_LOGGING_FILE.search(options):
        ours.append(f"-Dlog4j2.configurationFile={JVM_LOGGING}")
    if local and not _NAMES_A_COLLECTOR.search(options):
        ours.append(LOCAL_DRIVER_GC)
        if not _SIZES_THE_YOUNG_GENERATION.search(options):
            ours.append(LOCAL_DRIVER_YOUNG)
    combined = " ".join([*ours, options]).strip()
    return {DRIVER_JAVA_OPTIONS: combined} if combined else {}


def driver_memory(table_streams: int) -> str:
    """The driver heap for ``table_streams`` (tables times services), as Spark spells it.

    At least Spark's 1 GiB, rounded up to 256 MiB.
    """
    mib = max(MIN_HEAP_MIB, BASE_HEAP_MIB + HEAP_PER_TABLE_STREAM_MIB * table_streams)
    return f"{-(-mib // 256) * 256}m"


def with_sized_heap(config: SparkConfig, table_streams: int) -> SparkConfig:
    """``config`` with the driver heap :func:`driver_memory` gives ``table_streams``.

    Unchanged when ``spark.conf`` sets ``spark.driver.memory``: the operator's size wins.
    The heap is fixed when the JVM starts, so it is sized for the tables known then.
    """
    if DRIVER_MEMORY in config.conf:
        return config
    heap = driver_memory(table_streams)
    log.info(
        "driver heap sized for the tables",
        extra={"table_streams": table_streams, DRIVER_MEMORY: heap},
    )
    return config.model_copy(update={"conf": {DRIVER_MEMORY: heap, **config.conf}})


def build_spark_session(config: SparkConfig, app_name: str) -> SparkSession:
    """Create (or return the running) SparkSession configured for Delta and Kafka."""
    builder = SparkSession.builder
    conf = spark_conf(config, app_name)
    for key, value in conf.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    # A running session keeps its SQL settings: the Kafka secrets must be masked there too.
    session.conf.set(OPTIONS_REDACTION, conf[OPTIONS_REDACTION])
    # A session that was already running (tests, `cdc run`) ignores new spark.hadoop.*
    # entries: set the root's settings on its Hadoop configuration (per bucket, so
    # settings of other roots in the same session stay as they are).
    jvm_bridge.set_hadoop_options(session, config.hadoop_options())
    collect_python_garbage(float(conf.get(PYTHON_GC_INTERVAL) or 0))
    return session


def collect_python_garbage(interval_s: float) -> None:
    """Collect the driver's cyclic Python garbage every ``interval_s`` seconds, in a thread.

    py4j's gateway keeps every Java object Python holds a proxy of alive in the JVM, until
    Python frees the proxy. A proxy caches the methods called on it, and each cached
    method points back at the proxy: every proxy Python called a method on (each batch's
    DataFrames, their sessions and plans) is freed only by Python's cyclic collector.
    Python runs a full collection on its own allocation counts, rarely once a driver holds
    many objects and never while it idles, blind to the JVM's heap: with many streams the
    batches' plans pile up in the driver's heap until it runs out. One thread per process
    (the first interval wins); ``0`` or less starts none. A collection holds the
    interpreter lock for its duration.
    """
    if interval_s <= 0:
        return
    with _collector_lock:
        if any(thread.is_alive() for thread in _collectors):
            return

        def collect() -> None:
            while True:
                time.sleep(interval_s)
                started = time.monotonic()
                found = gc.collect()
                log.debug(
                    "python garbage collected",
                    extra={"objects": found, "ms": round((time.monotonic() - started) * 1000)},
                )

        thread = threading.Thread(target=collect, name="cdc-python-gc", daemon=True)
        thread.start()
        _collectors[:] = [thread]


def observed(
    observation: Observation, frame: DataFrame, metrics: Sequence[Column]
) -> dict[str, Any]:
    """The ``metrics`` ``observation`` collected over ``frame``, once its action has run.

    When Spark ran none of the observed plan (an empty micro-batch that adaptive
    execution proved empty), it collected nothing: the metrics are then computed from
    ``frame`` itself, one small job over an empty input.
    """
    if jvm_bridge.observation_collected(observation):
        return observation.get
    row = frame.agg(*metrics).first()
    assert row is not None  # an aggregate without grouping has one row
    return row.asDict(recursive=False)


def clock() -> Column:
    """The current time (millisecond precision), read when each row is computed.

    For columns of queries run every micro-batch. ``current_timestamp()`` becomes a
    literal when a query is planned, and Spark writes timestamp (and long) literals into
    the code it generates, so a query using it compiles its classes again every batch:
    tens of milliseconds of driver and executor CPU per class. This reads the clock at
    run time, so the code, and Spark's cache of compiled code, stays the same.
    """
    millis = F.reflect(F.lit("java.lang.System"), F.lit("currentTimeMillis"))
    return F.timestamp_millis(millis.cast("long"))


class BackgroundCall:
    """``call`` run in a thread that carries this thread's Spark job properties.

    Lets two independent Spark actions (e.g. commits to two tables) overlap; ``wait``
    joins the thread and raises what the call raised.
    """

    def __init__(self, call: Callable[[], object]) -> None:
        self._error: BaseException | None = None

        def run() -> None:
            try:
                call()
            except BaseException as error:
                self._error = error

        self._thread = InheritableThread(target=run, daemon=True)
        self._thread.start()

    @property
    def error(self) -> BaseException | None:
        """What the call raised (None: nothing, or not ended yet)."""
        return self._error

    def ended(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the call to end; whether it has."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Wait for the call to end; re-raise its exception, if any."""
        self._thread.join()
        if self._error is not None:
            raise self._error


def side_by_side(calls: Sequence[Callable[[], object]]) -> None:
    """Run ``calls`` at once; return when all have ended, raising the first error.

    Each runs in a thread carrying this thread's Spark job properties. Meant for starts
    that mostly wait (on Delta, servers, a source table): overlapped, they take about as
    long as the slowest. The calling thread stays free to take signals.
    """
    if len(calls) == 1:
        calls[0]()
        return
    background = [BackgroundCall(call) for call in calls]
    errors: list[BaseException] = []
    for call in background:
        while not call.ended(timeout_s=0.5):
            pass
        if call.error is not None:
            errors.append(call.error)
    if errors:
        raise errors[0]


@contextmanager
def cached_in_few_partitions(batch: DataFrame) -> Iterator[DataFrame]:
    """``batch`` read once, cached in as many partitions as the cluster has cores.

    A one query's batch is split by table with a filter per table, and a filter scans
    every partition of what it reads (a task each, empty or not): a batch read from 300
    Kafka partitions, or from the files of 100 Delta tables, would cost every job of
    every table that many tasks. Coalesced first (no shuffle: the source's partitions are
    read a few per task), each table's job is a task per core.
    """
    cores = max(1, batch.sparkSession.sparkContext.defaultParallelism)
    cached = batch.coalesce(cores).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        yield cached
    finally:
        cached.unpersist()


@contextmanager
def counting_jobs(spark: SparkSession) -> Iterator[Callable[[], int]]:
    """Tag the Spark jobs this thread (and threads it starts) runs inside the block.

    Yields a function that counts them (read it after the block: Spark records jobs
    through its listener bus, a moment after they start).
    """
    context = spark.sparkContext
    tag = f"cdc-count-{uuid.uuid4().hex}"
    context.addJobTag(tag)
    try:
        yield lambda: jvm_bridge.jobs_with_tag(spark, tag)
    finally:
        context.removeJobTag(tag)
