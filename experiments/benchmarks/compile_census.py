"""Where the suite's cold time goes: XLA's compile seconds and program count per test module and per test.

Runs the suite (``make test``'s pytest line, or the pytest arguments given) with an empty compilation cache, every
pytest process counting the programs XLA compiles during each test (``tests/helpers/compiles.py``'s ``Census``), and
prints the totals by module, by program name (a persistent-cache hit counts as a compilation of its load time) and
the heaviest tests. Notebooks run in kernels of their own and Ray's actors in processes of their own: neither is
counted (their cost shows as the wall time the census does not explain).

    .venv/bin/python experiments/benchmarks/compile_census.py                    # the whole suite, ~10 min on 2 cores
    .venv/bin/python experiments/benchmarks/compile_census.py tests/test_studies.py
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

SUITE = ["-n", "2", "--dist", "loadgroup", "--nbmake", "tests", "notebooks"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pytest_args", nargs="*", help="what pytest runs (default: make test's suite)")
    parser.add_argument("--top", type=int, default=25, help="how many modules and tests to list")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        prefix = os.path.join(scratch, "census")
        env = dict(os.environ, ASGD_JAX_CACHE_DIR=os.path.join(scratch, "cache"), ASGD_JAX_COMPILE_CENSUS=prefix)
        t0 = time.perf_counter()
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(args.pytest_args or SUITE)]
        done = subprocess.run(command, env=env, check=False)
        wall = time.perf_counter() - t0
        counted: dict[str, list[float]] = {}
        named: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
        for path in glob.glob(prefix + ".*.json"):
            with open(path) as f:
                one = json.load(f)
            counted.update(one["tests"])
            for name, (s, n) in one["programs"].items():
                named[name][0] += s
                named[name][1] += n
    seconds = sum(s for s, _ in counted.values())
    programs = sum(n for _, n in counted.values())
    print(f"\npytest exit {done.returncode}; wall {wall:.0f} s; XLA compiled {programs} programs in {seconds:.0f} s")
    modules: collections.Counter = collections.Counter()
    module_programs: collections.Counter = collections.Counter()
    for test, (s, n) in counted.items():
        modules[test.split("::")[0]] += s
        module_programs[test.split("::")[0]] += n
    print("\n| module | compile s | programs |\n|---|---|---|")
    for module, s in modules.most_common(args.top):
        print(f"| {module} | {s:.1f} | {module_programs[module]} |")
    print("\n| program | compile s | compilations |\n|---|---|---|")
    for name, (s, n) in sorted(named.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"| {name} | {s:.1f} | {n} |")
    print("\n| test | compile s | programs |\n|---|---|---|")
    for test, (s, n) in sorted(counted.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"| {test.split('@')[0]} | {s:.1f} | {n} |")


if __name__ == "__main__":
    main()
