"""Benchmark: the whole pipeline at steady offered loads, beside the seed-style baseline.

Figures, not a test: nothing here asserts a time. Needs nothing running: it starts the
local servers (``cdc infra up``, ports from ``CDC_INFRA_*``), then, for each pipeline in
turn (never both at once, so they do not share the CPU):

- cdc: the four services as separate processes (``cdc_devkit.processes``) on fresh topics,
  tables and indexes (``cdc_devkit.local_run.write_pipeline_config``);
- cdc-app: the same four services as one Spark application (``cdc run``);
- baseline (``--baseline``, the default): one Spark process with three queries per entity,
  the seed-style way: Spark's Kafka source -> ``from_avro`` with the one writer schema ->
  Delta append; bronze stream -> ``foreachBatch`` newest-per-key + plain MERGE into a
  silver table with Change Data Feed; silver CDF -> ``to_avro`` -> Spark's Kafka sink.

Load: the workload generator (``cdc_devkit.workload``) in ``--producers`` worker processes,
each on its own share of the key space; in-order inserts, updates and deletes with
tombstones, no re-deliveries, poison or schema change (so the plain MERGE of the
baseline is correct on it and the comparison is about speed only). The snapshot goes
first, unthrottled, before the pipeline is launched: the launch is a first start on
tables that each hold a snapshot, and the warm-up lasts until the snapshot is everywhere
(not measured as delays). Then each rate of ``--rates`` (Kafka messages per second,
tombstones included) for ``--seconds-per-rate``, after which production pauses until the
pipeline has drained (``--drain-timeout``).

Delay is measured on probe keys (``--probe-share`` of the key space, hot keys left out):
from the source record's Kafka timestamp (bronze ``kafka_timestamp``) to (a) the silver
commit that applied it (silver's Change Data Feed, ``_commit_timestamp``), (b) the moment
a read_committed consumer in this process reads its change event, (c) the moment a search
for the probe documents (every 0.5 s; ids query, versions only) returns its version.
Events superseded inside one micro-batch never reach an output and are not counted;
deletes are not counted (their change events carry the removed row's sequence).
Each hop is also timed on its own, per probe event that reached both of its ends: ingest
(Kafka timestamp to the bronze commit that added it: ours from bronze's Change Data Feed,
every table in one bronze, the commit's ``_commit_timestamp``; the baseline's from its
bronze tables' logs, which needs a local storage root), merge (bronze commit to silver
commit), publish to topic and to index (silver commit to (b) and (c)).

Sustainable: a rate step is sustainable when (1) the producers offered at least 95% of
the rate, (2) every probe key's last change reached every output within the drain timeout
after the step, and (3) the backlog did not grow: for each output, the median delay of
the events produced in the last quarter of the step exceeds that of the second quarter
by at most max(2 s, 25% of it, 5% of the step length). A step whose median delay is
over half its length shows no trend ("step too short"). The backlog itself is estimated
from the samples: events produced but not yet in the output, in the middle and at the
end of the step (sampled events that never reach an output, superseded in a batch, are
left out, so it is a lower bound). The highest sustainable load is the highest
sustainable rate; after a step that does not drain, higher rates are not run.

A whole database: ``--tables N`` runs N tables (copies of the example's entities taken in
turn, ``cdc_devkit.local_run``) in every pipeline, the baseline's three queries per table
included. The skewed case, every table changing: ``--hot K`` puts ``--hot-share S`` (0.7)
of the changes on the first K tables and the rest on the others (``WorkloadSpec.hot_tables``;
``--hot-tables`` and ``--hot-tables-share`` are the same options), and the delays of the
hot and the cold tables are then also given apart. Every step's delays are also given per
table, and the worst table's p99 beside them (with its samples: a table's p99 needs 2 of
its probe events, and a cold table of many has few): the goal is every table's delay,
not the whole's. A pipeline named ``KIND@N`` in ``--pipelines`` runs on N tables instead,
so one invocation compares table counts (``cdc-app@2,cdc-app@100 --hot 2 --hot-share 1``:
the load on 2 tables, 98 idle); ``--snapshot-rows`` makes each table's snapshot smaller.

Each pipeline's start is reported too: launch until healthy (every service's ``/health``
200; the baseline: its queries started); the first start, launch until every table's
first change event was readable in its change topic (each table held its snapshot at the
launch; the change topics are made beforehand, as publisher-kafka makes them, and read
from their start); and launch until every table's snapshot was in its change topic.
Resources: CPU seconds per process group over each step and its drain, per 1,000 events
produced in the step (the pipeline's own processes summed); peak RSS per process group,
and the most the pipeline's own processes held at one time (sampled every second). A
first table of all of these, one row per pipeline and rate, puts the delay to the change
topic (all tables, hot, cold, the worst table's p99), the starts, the peak RSS and the CPU
per 1,000 events of ours beside the baseline's.

Writes ``results.json``, ``results.md`` and ``plot.svg`` (delay percentiles and lag over
time) under ``--workdir``, and prints the tables.

    .venv/bin/python tests/bench/bench_e2e.py [--rates 1000,5000,20000]
        [--seconds-per-rate 180] [--keys 100000] [--workdir data/bench-e2e]
        [--pipelines cdc,cdc-app,baseline] [--tables 100 --hot 2 --hot-share 0.7]
        [--snapshot-rows N] [--no-history] [--no-index]
"""
