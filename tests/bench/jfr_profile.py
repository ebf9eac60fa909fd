"""Where a JVM's CPU went: a summary of a Java Flight Recorder recording's CPU samples.

Record a service (or ``cdc run``) by giving its driver JVM a recording, e.g. for the
end-to-end bench (a folder as file name: every JVM writes its own file)::

    PYSPARK_SUBMIT_ARGS="--driver-java-options \
'-XX:StartFlightRecording=filename=/tmp/jfr/,settings=profile,dumponexit=true' pyspark-shell" \
        .venv/bin/python tests/bench/bench_e2e.py --pipelines cdc-app --no-baseline ...
    .venv/bin/python tests/bench/jfr_profile.py /tmp/jfr/hotspot-pid-*.jfr [--match TEXT ...]

Prints the share of samples per thread group, the hottest methods (self time), the share
of samples under each of a few named kinds of work (a sample can count in several), and
for each ``--match`` the share of samples with a frame containing that text. JFR samples
running Java threads only: time in native code, GC and JIT compilation is not in it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

#: Kinds of work, each recognised by text in any frame of a sample.
KINDS: dict[str, tuple[str, ...]] = {
    "code generation (per task and per plan)": ("CodeGenerator", "CodegenContext"),
    "code compilation (janino)": ("org.codehaus.janino",),
    "query analysis": ("Analyzer.execute",),
    "query optimisation and planning": ("Optimizer", "SparkPlanner", "QueryPlanner"),
    "task and closure serialisation": ("ObjectOutputStream",),
    "parquet writing": ("ParquetOutputWriter", "ParquetFileWriter"),
    "parquet reading": ("VectorizedParquetRecordReader", "ParquetFileReader"),
    "delta snapshot and log": ("DeltaLog.update", "SnapshotManagement", "Checkpoints"),
    "delta commit": ("OptimisticTransactionImpl.commit",),
    "delta merge": ("MergeIntoCommand",),
    "kafka client": ("org.apache.kafka.clients",),
    "py4j (calls from and to Python)": ("py4j.",),
    "python listener (progress events)": ("PythonStreamingQueryListenerWrapper",),
    "class lookups (Class.forName)": ("Class.forName",),
    "spark listener bus": ("ListenerBus",),
}


def jfr_tool() -> str:
    """The JDK's ``jfr`` command: beside ``$JAVA_HOME/bin/java``, else on the PATH."""
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "jfr").exists():
        return str(Path(home) / "bin" / "jfr")
    found = shutil.which("jfr") or shutil.which("java")
    if found is None:
        raise SystemExit("no JDK found: set JAVA_HOME")
    tool = Path(found).resolve().parent / "jfr"
    if not tool.exists():
        raise SystemExit(f"{tool} does not exist: set JAVA_HOME to a full JDK")
    return str(tool)


def samples(recording: Path, depth: int) -> Iterator[tuple[str, list[str]]]:
    """Each CPU sample of the recording: its thread's name and its frames, top first."""
    command = [jfr_tool(), "print", "--events", "jdk.ExecutionSample"]
    command += ["--stack-depth", str(depth), str(recording)]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as printer:
        assert printer.stdout is not None
        thread, in_stack = "", False
        frames: list[str] = []
        for line in printer.stdout:
            text = line.strip()
            if text.startswith("sampledThread"):
                named = re.search(r'"(.*)"', text)
                thread = named.group(1) if named else text
            elif text.startswith("stackTrace = ["):
                frames, in_stack = [], True
            elif in_stack and text.startswith("]"):
                in_stack = False
                yield thread, frames
            elif in_stack and text and text != "...":
                frames.append(re.sub(r"\s+line:.*", "", text))
    if printer.returncode:
        raise SystemExit(f"{' '.join(command)} exited {printer.returncode}")


def thread_group(name: str) -> str:
    """A thread's name without its numbers and query ids: threads of one kind together."""
    name = re.sub(r"\[id = .*", "", name)
    return re.sub(r"\d+", "N", name).strip()


def _print_shares(title: str, counts: Counter[str], total: int, top: int) -> None:
    print(f"\n## {title}\n")
    for name, count in counts.most_common(top):
        print(f"{100 * count / total:5.1f}%  {count:7,}  {name}")


def main() -> None:
    """Read the recording, print the summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recording", type=Path)
    parser.add_argument("--match", action="append", default=[], help="text of a frame")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--depth", type=int, default=120, help="frames read per sample")
    args = parser.parse_args()
    threads: Counter[str] = Counter()
    hottest: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    matches: Counter[str] = Counter()
    total = 0
    for thread, frames in samples(args.recording, args.depth):
        total += 1
        threads[thread_group(thread)] += 1
        hottest[frames[0] if frames else "?"] += 1
        for kind, texts in KINDS.items():
            if any(text in frame for frame in frames for text in texts):
                kinds[kind] += 1
        for text in args.match:
            if any(text in frame for frame in frames):
                matches[text] += 1
    if not total:
        raise SystemExit(f"{args.recording}: no CPU samples (was the recording's profile on?)")
    print(f"# {args.recording.name}: {total:,} CPU samples")
    _print_shares("threads", threads, total, args.top)
    _print_shares("hottest methods (self)", hottest, total, args.top)
    _print_shares("kinds of work (a sample may count in several)", kinds, total, len(KINDS))
    if args.match:
        _print_shares("matches", matches, total, len(args.match))


if __name__ == "__main__":
    main()
