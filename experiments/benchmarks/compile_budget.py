"""What `make demo`'s ablation spends on compilation: programs compiled, compile seconds and wall time, cold and warm.

Runs ``asgd-jax ablate --quick`` (what ``make demo`` runs) in fresh processes, one after another:

* ``off``: the persistent compilation cache disabled (``ASGD_JAX_CACHE_DIR=off``): every program compiled;
* ``cold``: the cache on, in an empty folder (every program compiled, and written);
* ``warm``: the same folder again (every program loaded).

Each process counts XLA compilations with a :mod:`jax.monitoring` listener (``backend_compile_duration`` events: a
cache hit is counted too, with its load time) and tracing/lowering time, and times the ablation end to end (from the
command line's start to its table; the interpreter's start and imports excluded, the same for every row). The studies
compile each arm's programs on a thread of their own while the earlier arms compute, so the compilation a user waits
for is less than the compilation done: "waited" is the time the run stood still for the compiler (the simulator's
``compile_wait_duration`` events, plus the programs compiled where they run: eager operations, the model's init).

    .venv/bin/python experiments/benchmarks/compile_budget.py            # ~3 minutes on 2 cores
    .venv/bin/python experiments/benchmarks/compile_budget.py --names    # and the programs by name
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import collections, json, sys, time
import jax
import threading
events = collections.defaultdict(float)
names = collections.Counter()
main_thread = threading.main_thread()
def listen(event, duration, **kw):
    events[event.rsplit("/", 1)[-1]] += duration
    if event.endswith("backend_compile_duration"):
        names[kw.get("fun_name", "?")] += 1
        if threading.current_thread() is main_thread and "simulator_" not in kw.get("fun_name", ""):
            events["main_thread_compile"] += duration  # eager ops, the model's init: compiled where they run
jax.monitoring.register_event_duration_secs_listener(listen)
from asgd_jax.cli import main
start = time.perf_counter()
code = main(["ablate", "--quick", "--no-progress", "--out", sys.argv[1]])
wall = time.perf_counter() - start
print("RESULT " + json.dumps({"code": code, "wall": wall, "events": events, "names": names}))
"""


def measure(cache: str, out: str) -> dict:
    env = {**os.environ, "ASGD_JAX_CACHE_DIR": cache}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    run = subprocess.run([sys.executable, "-c", CHILD, out], env=env, capture_output=True, text=True, check=False)
    line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"the ablation failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}")
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--names", action="store_true", help="list the compiled programs by name")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "xla")
        rows = {
            "off": measure("off", os.path.join(tmp, "a")),
            "cold": measure(folder, os.path.join(tmp, "b")),
            "warm": measure(folder, os.path.join(tmp, "c")),
        }
    print("| cache | wall (s) | XLA compile or load, all threads (s) | waited for it (s) | of the wall | programs |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        ev = r["events"]
        compile_s = ev.get("backend_compile_duration", 0.0)
        waited = ev.get("compile_wait_duration", 0.0) + ev.get("main_thread_compile", 0.0)
        programs = sum(r["names"].values())
        print(
            f"| {name} | {r['wall']:.1f} | {compile_s:.1f} | {waited:.1f} | {100 * waited / r['wall']:.0f}% | "
            f"{programs} |"
        )
    print(f"\nwarm ÷ off: {rows['warm']['wall'] / rows['off']['wall']:.2f} (wall)")
    if args.names:
        for name, n in sorted(rows["off"]["names"].items(), key=lambda kv: -kv[1]):
            print(f"{n:3d}  {name}")


if __name__ == "__main__":
    main()
