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
first (warm-up, not measured); then each rate of ``--rates`` (Kafka messages per second,
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
(Kafka timestamp to the bronze commit that added it, from bronze's log: needs a local
storage root), merge (bronze commit to silver commit), publish to topic and to index
(silver commit to (b) and (c)).

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
included; ``--hot-tables K`` puts ``--hot-tables-share`` (0.7) of the changes on the first
K tables and the rest on the others (``WorkloadSpec.hot_tables``), and then also gives
the delays of the hot and the cold tables apart; ``--one-query`` runs each of our
services as one query for all its tables (the baseline keeps its queries per table).
A pipeline named ``KIND@N`` in ``--pipelines`` runs on N tables instead, so one invocation
compares table counts (``cdc-app@2,cdc-app@100 --hot-tables 2 --hot-tables-share 1``:
the load on 2 tables, 98 idle); ``--snapshot-rows`` makes each table's snapshot smaller.
Each pipeline's start (launch until healthy) is reported too.

Writes ``results.json``, ``results.md`` and ``plot.svg`` (delay percentiles and lag over
time) under ``--workdir``, and prints the tables.

    .venv/bin/python tests/bench/bench_e2e.py [--rates 1000,5000,20000]
        [--seconds-per-rate 180] [--keys 100000] [--workdir data/bench-e2e]
        [--pipelines cdc,cdc-app,baseline] [--tables 24 --hot-tables 2 --one-query]
"""
