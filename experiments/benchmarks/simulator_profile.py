"""Where one simulated update's time goes, op by op: the floor and the simulator's engines from a profiler trace.

Traces a few calls of one compiled chunk (``jax.profiler`` with a Perfetto trace) for the floor of
``simulator_overhead.py`` (plain ``optax.sgd`` in a ``lax.scan``) and the simulator's engines, and prints per update:
the wall time, the number of device ops (kernels on a GPU, thunks on a CPU), their summed time, and the ops that take
the most. On a GPU a small model's update is launch-bound, so the op count is what separates the engines; on a CPU it
is memory passes (see ``experiments/benchmarks/README.md``).

    .venv/bin/python experiments/benchmarks/simulator_profile.py                 # W on this machine, ~1 minute
    .venv/bin/python experiments/benchmarks/simulator_profile.py --workload L --top 12
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import shutil
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import simulator_overhead as bench

import asgd_jax

HOST_NAMES = ("ThunkExecutor", "SlinkyThreadPool", "PjitFunction", "PjRt", "Execute", "TfrtCpu", "XlaModule", "Thunk")


def chunk_runner(wl, engine: str, length: int):
    """``(run, carry, hlo)``: one compiled chunk of ``length`` updates, its first input and its optimised HLO."""
    if engine == "floor":
        fn = bench.floor_chunk(wl, length)
        carry = bench.floor_carry(wl)
        compiled = fn.lower(carry, jax.random.key(0)).compile()
        return (lambda c: compiled(c, jax.random.key(0))), carry, compiled.as_text()
    delays, rule, extra = bench.ENGINES[engine]()
    key = jax.random.key(0)
    plan = asgd_jax.Plan(delays, batch_size=wl["batch_size"], chunk=length, **extra)
    lowered = asgd_jax.simulator.lower(
        wl["loss"],
        rule,
        wl["params"],
        wl["data"],
        plan,
        key=key,
    )
    compiled = lowered.compile()
    state = asgd_jax.simulator.init(rule, wl["params"], plan, key=key)
    data = jax.tree.map(jnp.asarray, wl["data"])
    numbers = {"rule": asgd_jax.recipes.of(rule).numbers, "delays": asgd_jax.delays.split(delays)[1]}
    numbers["local_lr"] = np.float32(0.0)
    return (lambda s: compiled(s, data, key, {}, numbers)[0]), state, compiled.as_text()


def profile(wl, engine: str, length: int, calls: int, top: int, hlo_dir: str | None) -> None:
    run, carry, hlo = chunk_runner(wl, engine, length)
    if hlo_dir:
        os.makedirs(hlo_dir, exist_ok=True)
        name = "".join(c if c.isalnum() else "_" for c in engine)
        with open(os.path.join(hlo_dir, f"{name}.hlo.txt"), "w") as f:
            f.write(hlo)
    carry = jax.block_until_ready(run(carry))  # compile and warm up
    start = time.perf_counter()  # untraced: the profiler's own cost stays out of the wall time
    for _ in range(calls):
        carry = jax.block_until_ready(run(carry))
    wall = (time.perf_counter() - start) / (calls * length)
    folder = tempfile.mkdtemp(prefix="asgd_jax_profile_")
    try:
        jax.profiler.start_trace(folder, create_perfetto_trace=True)
        for _ in range(calls):
            carry = jax.block_until_ready(run(carry))
        jax.profiler.stop_trace()
        path = glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True)[0]
        with gzip.open(path) as f:
            trace = json.loads(f.read())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    on_device = any("gpu" in n.lower() or "/device:" in n.lower() for n in names.values())
    total: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for e in events:
        if e.get("ph") != "X" or e["name"].startswith("$") or any(h in e["name"] for h in HOST_NAMES):
            continue
        process = names.get(e.get("pid"), "")
        if on_device and not ("gpu" in process.lower() or "/device:" in process.lower()):
            continue
        total[e["name"]] += e.get("dur", 0.0)
        count[e["name"]] += 1
    n = calls * length
    ops = sum(count.values()) / n
    print(
        f"  {engine:28s} wall {1e6 * wall:8.1f} μs/update, {ops:6.1f} ops/update, "
        f"{sum(total.values()) / n:8.1f} μs of ops/update"
    )
    for name, t in total.most_common(top):
        print(f"      {t / n:8.1f} μs  {count[name] / n:5.2f}x  {name[:90]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="W", choices=["W", "L"])
    parser.add_argument("--engines", nargs="+", default=["floor", *bench.ENGINES])
    parser.add_argument("--length", type=int, default=50, help="updates per chunk")
    parser.add_argument("--calls", type=int, default=3, help="chunks traced")
    parser.add_argument("--top", type=int, default=8, help="ops listed per engine")
    parser.add_argument("--hlo", default=None, metavar="DIR", help="write each engine's optimised HLO there")
    args = parser.parse_args()
    widths = (64, 256, 256, 10) if args.workload == "W" else (64, 1024, 1024, 10)
    wl = bench.mlp_workload(widths, 64)
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}; workload {args.workload}, {args.length} updates "
        f"per chunk, {args.calls} chunks traced"
    )
    for engine in args.engines:
        profile(wl, engine, args.length, args.calls, args.top, args.hlo)


if __name__ == "__main__":
    main()
