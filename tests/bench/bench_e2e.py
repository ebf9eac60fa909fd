"""Benchmark: the whole pipeline at steady offered loads, beside the seed-style baseline.

The command; the code is the package ``e2e_bench`` beside this file (what it measures and how:
its docstring). The baseline's process is this command with ``--run-baseline``.

    .venv/bin/python tests/bench/bench_e2e.py [--rates 1000,5000,20000]
        [--seconds-per-rate 180] [--keys 100000] [--workdir data/bench-e2e]
        [--pipelines cdc,cdc-app,baseline] [--tables 100 --hot 2 --hot-share 0.7]
        [--snapshot-rows N] [--no-history] [--no-index]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the package, however this is run

from e2e_bench.cli import main

if __name__ == "__main__":
    main()
