"""What a notebook user waits for: one ``simulate`` call timed end to end (compilation included), beside the floor.

The floor is what a user writes without this project: ``optax.sgd`` in a plain ``jax.lax.scan`` over minibatches
drawn with ``jax.random.randint``, jitted once with the learning rate and the key as arguments (so a second call with
another learning rate compiles nothing). Against it, ``asgd_jax.simulate`` with ``Workers(8)`` and DC-ASGD-a (global
MeanSquare, λ0 = 2), as a user calls it in a notebook cell:

* first call: nothing compiled in this process (the in-process caches cleared, the persistent cache off);
* second call: the same arguments again;
* another lr and seed: a new rule (``dc_asgd(2 * lr, ...)``) and another key, the same structure.

Beside the floor, the same algorithm written by hand (``simulator_overhead.py``'s hand-written ``Workers(8)``
DC-ASGD-a, the workers pushing in turn), also jitted once with the learning rate as an argument: what the simulator's
second call costs beyond the algorithm itself.

Each figure is the median of interleaved repeats, as a ratio to the floor's second call (its steady state, measured in
the same repeat), and the first call's fixed cost (first call minus second call) in seconds beside the XLA compile and
tracing time JAX reports for it. Workloads as in ``simulator_overhead.py``: W (MLP 64-256-256-10, batch 64, 2,000
updates), L (MLP 64-1024-1024-10, 1.1M parameters, 300 updates) and cnn (asgd_jax's cnn on mnist1d, batch 32, 1,000
updates). The script also runs against the API before the run was one value (``simulate(..., delays=..., batch_size=
..., num_updates=...)``), to measure the code before a change on the same machine.

    .venv/bin/python experiments/benchmarks/end_to_end.py                 # ~6 minutes on 2 cores
    .venv/bin/python experiments/benchmarks/end_to_end.py --only W --repeats 5
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)  # a first call compiles: no persistent cache

import jax
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from simulator_overhead import cnn_workload, floor_carry, hand_async_step, minibatch_gradient, mlp_workload

import asgd_jax

LR = 0.01
WORKLOADS = {
    "W": (lambda: mlp_workload((64, 256, 256, 10), 64), 2_000),
    "L": (lambda: mlp_workload((64, 1024, 1024, 10), 64), 300),
    "cnn": (lambda: cnn_workload(32), 1_000),
}
COMPILE_EVENTS = ("backend_compile_duration", "jaxpr_trace_duration", "jaxpr_to_mlir_module_duration")
events: collections.Counter = collections.Counter()
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: events.update({event.rsplit("/", 1)[-1]: duration})
)


def floor(wl, updates: int):
    """The floor, jitted once: ``(params, lr, key) -> params`` after ``updates`` plain SGD steps."""
    gradient = minibatch_gradient(wl)

    def run(params, lr, key):
        opt = optax.sgd(lr)

        def step(c, k):
            p, s = c
            u, s = opt.update(gradient(p, k), s, p)
            return (optax.apply_updates(p, u), s), None

        return jax.lax.scan(step, (params, opt.init(params)), jax.random.split(key, updates))[0][0]

    return jax.jit(run)


def hand(wl, updates: int):
    """The same algorithm as the simulator's ``Workers(8)`` DC-ASGD-a written by hand in plain JAX, nothing of ours
    (``simulator_overhead.py``'s: per-worker backups, the workers pushing in turn, the gradient at the pusher's backup,
    then its pull), jitted once with the learning rate and the key as arguments: ``(carry, lr, key) -> carry``."""
    gradient = minibatch_gradient(wl)

    def run(carry, lr, key):
        step = hand_async_step(gradient, "dc_asgd_a", lr)
        return jax.lax.scan(step, carry, jax.random.split(key, updates))[0][0]

    return jax.jit(run)


def simulate(wl, updates: int, lr: float, seed: int):
    rule = asgd_jax.dc_asgd(lr, 2.0, adaptive=True)
    args = (wl["loss"], rule, wl["params"], wl["data"])
    if hasattr(asgd_jax, "Plan"):
        plan = asgd_jax.Plan(asgd_jax.delays.Workers(8), batch_size=wl["batch_size"], num_updates=updates)
        return asgd_jax.simulate(*args, plan, key=jax.random.key(seed), progress=False).params
    delays = asgd_jax.delays.Workers(8)  # the keyword API of before
    kw = dict(delays=delays, batch_size=wl["batch_size"], num_updates=updates, key=jax.random.key(seed))
    return asgd_jax.simulate(*args, progress=False, **kw).params


def timed(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def forget() -> None:
    """Nothing compiled survives: JAX's caches and the simulator's programs."""
    jax.clear_caches()
    clear = getattr(asgd_jax.simulator, "clear_cache", None)
    if clear is not None:
        clear()


def measure(name: str, repeats: int) -> dict[str, float]:
    make, updates = WORKLOADS[name]
    wl = make()
    rows = collections.defaultdict(list)
    for _ in range(repeats):
        forget()
        run = floor(wl, updates)
        rows["floor first"].append(timed(lambda run=run: run(wl["params"], LR, jax.random.key(0))))
        rows["floor second"].append(timed(lambda run=run: run(wl["params"], 2 * LR, jax.random.key(1))))
        forget()
        by_hand = hand(wl, updates)
        for row, lr, seed in (("hand first", LR, 0), ("hand second", 2 * LR, 1)):
            carry = floor_carry(wl, "dc_asgd_a")  # made before the clock starts
            rows[row].append(timed(lambda f=by_hand, c=carry, lr=lr, k=seed: f(c, lr, jax.random.key(k))))
        forget()
        events.clear()
        rows["first"].append(timed(lambda: simulate(wl, updates, LR, 0)))
        rows["compile"].append(sum(events[e] for e in COMPILE_EVENTS))
        rows["second"].append(timed(lambda: simulate(wl, updates, LR, 0)))
        rows["other lr and seed"].append(timed(lambda: simulate(wl, updates, 2 * LR, 1)))
    med = {k: statistics.median(v) for k, v in rows.items()}
    for name in ("floor", "hand"):
        ratios = [s / f for s, f in zip(rows["other lr and seed"], rows[f"{name} second"], strict=True)]
        med[f"other ÷ {name}"] = statistics.median(ratios)
    return med


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} cores; median of {args.repeats}")
    print(
        "| workload | floor first | floor second | by hand first | by hand second | simulate first | "
        "fixed cost (compile + trace) | second | other lr and seed | ÷ floor second | ÷ by hand second |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.only:
        m = measure(name, args.repeats)
        fixed = m["first"] - m["second"]
        print(
            f"| {name} | {m['floor first']:.2f} s | {m['floor second']:.3f} s | {m['hand first']:.2f} s | "
            f"{m['hand second']:.3f} s | {m['first']:.2f} s | {fixed:.2f} s ({m['compile']:.2f} s) | "
            f"{m['second']:.3f} s | {m['other lr and seed']:.3f} s | {m['other ÷ floor']:.2f} | "
            f"{m['other ÷ hand']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
