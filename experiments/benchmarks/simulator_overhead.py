"""What does simulating asynchrony cost over a hand-written ``lax.scan``? Ratios measured side by side in one run.

The floor is what a user writes without this project: ``optax.sgd`` in a plain ``jax.lax.scan`` over minibatches
drawn with ``jax.random.randint``, nothing from asgd_jax in the loop. Against it, ``asgd_jax.simulate`` with

* ``FixedDelay(0)`` and ASGD: this *is* sequential SGD, so everything above the floor is the engine's;
* ``Workers(1)``, ``Workers(8)`` with ASGD, and ``Workers(8)`` with DC-ASGD-a (global MeanSquare);
* (n_sync) ``Workers(8)``, ASGD, ``n_sync=4, push="accumulate"``: four minibatches per exchange, so its time is
  compared with four floor updates.

Workloads (the model is the workload, the same function on both sides):

* ``W``: MLP 64-256-256-10 without biases (84,480 parameters), random 4096 x 64 data, batch 64;
* ``L``: MLP 64-1024-1024-10 without biases (1,124,352 parameters, 4.5 MB), same data, batch 64;
* ``cnn``: asgd_jax's ``cnn`` on mnist1d, batch 32.

Two figures per engine, both as a ratio to the floor measured in the same repeat:

* steady state: both sides run in equal chunks (a progress/checkpoint interval each) and the first is discarded, so
  compilation is excluded on both sides;
* end to end: one call from arguments to result, compilation included on both sides (what a notebook user waits).

Then a 16-run ``sweep`` (4 seeds x 4 DC-ASGD-a lambdas) on W, as GFLOP/s (FLOPs per update from XLA's cost analysis
of one gradient) and as a fraction of this machine's float32 matmul peak measured in the same script, against the
floor vmapped over 16 runs (the best a hand-written sweep does); and the simulator's state and XLA memory versus the
number of workers M. Repeats are interleaved, so drift on a shared machine hits all engines alike; medians are shown.

    .venv/bin/python experiments/benchmarks/simulator_overhead.py            # ~8 minutes on 2 cores
    .venv/bin/python experiments/benchmarks/simulator_overhead.py --quick    # ~3 minutes
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import asgd_jax

LR = 0.01
HAND_WORKERS = 8


# --------------------------------------------------------------------------------------------------------------------
# Workloads: a loss, initial weights, data.
# --------------------------------------------------------------------------------------------------------------------


def mlp_workload(widths: tuple[int, ...], batch_size: int):
    keys = jax.random.split(jax.random.key(0), len(widths) + 1)
    params = [
        jax.random.normal(k, (a, b), jnp.float32) / np.sqrt(a)
        for k, a, b in zip(keys, widths[:-1], widths[1:], strict=False)
    ]
    x = jax.random.normal(keys[-1], (4096, widths[0]), jnp.float32)
    y = jax.random.randint(keys[-2], (4096,), 0, widths[-1])

    def loss(ws, batch):
        h = batch["x"]
        for w in ws[:-1]:
            h = jax.nn.relu(h @ w)
        return optax.softmax_cross_entropy_with_integer_labels(h @ ws[-1], batch["y"]).mean()

    return {"loss": loss, "params": params, "data": {"x": x, "y": y}, "batch_size": batch_size}


def cnn_workload(batch_size: int):
    ds = asgd_jax.data.load("mnist1d")
    model = asgd_jax.models.get("cnn", num_classes=10, input_shape=ds.input_shape)
    params, _ = model.init(jax.random.key(0))  # no model state

    def loss(p, batch):
        logits, _ = model.apply(p, {}, batch["x"], train=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    data = {"x": jnp.asarray(ds.x_train), "y": jnp.asarray(ds.y_train)}
    return {"loss": loss, "params": params, "data": data, "batch_size": batch_size}


def num_params(params) -> int:
    return sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(params))


# --------------------------------------------------------------------------------------------------------------------
# The floor: plain optax.sgd in a lax.scan, nothing of ours.
# --------------------------------------------------------------------------------------------------------------------


def minibatch_gradient(wl) -> Callable:
    """``(params, key) -> gradient`` on a minibatch drawn with ``jax.random.randint``, as the floor draws it."""
    loss, data, batch_size = wl["loss"], wl["data"], wl["batch_size"]
    n = jax.tree.leaves(data)[0].shape[0]

    def gradient(params, k):
        idx = jax.random.randint(k, (batch_size,), 0, n)
        return jax.grad(loss)(params, jax.tree.map(lambda a: a[idx], data))

    return gradient


def hand_server_step(kind: str, w, g, mean_square, stale, lr=LR):
    """The hand-written server step on weights ``w`` (a pytree or one array): ASGD's ``w - lr g``, or DC-ASGD-a's
    compensated step with one global MeanSquare (m = 0.95, λ0 = 2, ε = 1e-7, as ``asgd_jax.dc_asgd(adaptive=True)``),
    at learning rate ``lr`` (a number, or a traced argument). Returns ``(w, mean_square)``."""
    if kind == "dc_asgd_a":
        mean_square = jax.tree.map(lambda ms, g: 0.95 * ms + 0.05 * g * g, mean_square, g)
        g = jax.tree.map(
            lambda g, w, wb, ms: g + 2.0 / jnp.sqrt(ms + 1e-7) * g * g * (w - wb), g, w, stale, mean_square
        )
    return jax.tree.map(lambda w, g: w - lr * g, w, g), mean_square


def hand_async_step(gradient: Callable, kind: str, lr) -> Callable:
    """The hand-written ``Workers(8)`` engine's scan step over ``(params, mean_square, backups, t)``: worker ``t % M``
    pushes its gradient at its backup, then pulls (``backups.at[m].set(w)``); ``lr`` a number or a traced argument."""

    def step(c, k):
        params, mean_square, backups, t = c
        m = t % HAND_WORKERS
        stale = jax.tree.map(lambda b: b[m], backups)
        params, mean_square = hand_server_step(kind, params, gradient(stale, k), mean_square, stale, lr)
        backups = jax.tree.map(lambda b, w: b.at[m].set(w), backups, params)
        return (params, mean_square, backups, t + 1), None

    return step


def floor_chunk(wl, length: int, runs: int | None = None, kind: str = "sgd") -> Callable:
    """A fresh jitted chunk of ``length`` updates (fresh: every call compiles, as a new user's would).

    ``kind="sgd"`` is the floor: plain ``optax.sgd``. ``"asgd"`` and ``"dc_asgd_a"`` are the same algorithms as the
    simulator's ``Workers(8)`` engines written by hand, nothing of ours: ``HAND_WORKERS`` per-worker backups, the
    workers pushing in turn (worker ``t % M``: staleness M - 1), the gradient at the pusher's backup, then its pull
    (``backups.at[m].set(w)``), :func:`hand_server_step`. What this project's engine should cost no more than.
    """
    gradient, opt = minibatch_gradient(wl), optax.sgd(LR)

    def sgd_step(c, k):
        params, opt_state = c
        updates, opt_state = opt.update(gradient(params, k), opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), None

    def chunk(carry, key):
        step = sgd_step if kind == "sgd" else hand_async_step(gradient, kind, LR)
        carry, _ = jax.lax.scan(step, carry, jax.random.split(key, length))
        return carry

    if runs is not None:
        chunk = jax.vmap(chunk)
    return jax.jit(chunk, donate_argnums=0)


def floor_carry(wl, kind: str = "sgd"):
    """The first input of :func:`floor_chunk` (fresh arrays: the chunk donates it)."""
    params = wl["params"]
    if kind == "sgd":
        return jax.tree.map(jnp.copy, (params, optax.sgd(LR).init(params)))
    backups = jax.tree.map(lambda x: jnp.broadcast_to(x, (HAND_WORKERS, *x.shape)).copy(), params)
    return jax.tree.map(jnp.copy, params), jax.tree.map(jnp.zeros_like, params), backups, jnp.int32(0)


def time_floor(wl, updates: int, chunks: int, runs: int | None = None, kind: str = "sgd") -> tuple[float, float]:
    """``(steady seconds per update, end-to-end seconds)`` of the floor (or a hand-written ``kind``), chunked like
    the simulator."""
    length = updates // chunks
    start = time.perf_counter()
    chunk = floor_chunk(wl, length, runs, kind)
    carry = floor_carry(wl, kind)
    keys = jax.random.split(jax.random.key(1), chunks)
    if runs is not None:
        carry = jax.tree.map(lambda x: jnp.broadcast_to(x, (runs, *x.shape)).copy(), carry)
        keys = jax.vmap(lambda k: jax.random.split(k, runs))(keys)
    stamps = []
    for c in range(chunks):
        carry = jax.block_until_ready(chunk(carry, keys[c]))
        stamps.append(time.perf_counter())
    return (stamps[-1] - stamps[0]) / (updates - length), stamps[-1] - start


# --------------------------------------------------------------------------------------------------------------------
# The simulator.
# --------------------------------------------------------------------------------------------------------------------


ENGINES = {
    "FixedDelay(0), ASGD": lambda: (asgd_jax.delays.FixedDelay(0), asgd_jax.asgd(LR), {}),
    "Workers(1), ASGD": lambda: (asgd_jax.delays.Workers(1), asgd_jax.asgd(LR), {}),
    "Workers(8), ASGD": lambda: (asgd_jax.delays.Workers(8), asgd_jax.asgd(LR), {}),
    "Workers(8), DC-ASGD-a": lambda: (asgd_jax.delays.Workers(8), asgd_jax.dc_asgd(LR, 2.0, adaptive=True), {}),
    "Workers(8), ASGD, n_sync 4": lambda: (
        asgd_jax.delays.Workers(8),
        asgd_jax.asgd(LR),
        {"n_sync": 4, "push": "accumulate"},
    ),
}


def time_simulate(wl, updates: int, chunks: int, engine: str) -> tuple[float, float]:
    """``(steady seconds per minibatch, end-to-end seconds)`` of one ``simulate`` call in ``chunks`` chunks."""
    delays, rule, extra = ENGINES[engine]()
    n_sync = extra.get("n_sync", 1)
    num_updates = updates // n_sync
    stamps = []
    start = time.perf_counter()
    asgd_jax.simulate(
        wl["loss"],
        rule,
        wl["params"],
        wl["data"],
        asgd_jax.Plan(
            delays, batch_size=wl["batch_size"], num_updates=num_updates, chunk=num_updates // chunks, **extra
        ),
        progress=False,
        callback=lambda done, st: (jax.block_until_ready(st.server.params), stamps.append(time.perf_counter())),
    )
    per_chunk = num_updates // chunks
    return (stamps[-1] - stamps[0]) / ((num_updates - per_chunk) * n_sync), stamps[-1] - start


HAND = {"Workers(8), ASGD": "asgd", "Workers(8), DC-ASGD-a": "dc_asgd_a"}  # engine -> its hand-written kind


def compare(name: str, wl, updates: int, chunks: int, repeats: int) -> dict[str, tuple[float, float, float, float]]:
    """Interleaved repeats; per engine the medians of (μs/update, ratio) steady and (s, ratio) end to end, and for
    the engines in ``HAND`` the steady ratio to the same algorithm written by hand (measured in the same repeat)."""
    updates -= updates % (
        4 * chunks
    )  # equal chunks for n_sync 4 too (a shorter last chunk would compile in the timing)
    steady: dict[str, list[float]] = {}
    e2e: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    e2e_ratios: dict[str, list[float]] = {}
    hand_ratios: dict[str, list[float]] = {}
    for _ in range(repeats):
        floor, floor_e2e = time_floor(wl, updates, chunks)
        steady.setdefault("floor", []).append(floor)
        e2e.setdefault("floor", []).append(floor_e2e)
        hand = {kind: time_floor(wl, updates, chunks, kind=kind) for kind in HAND.values()}
        for engine in ENGINES:
            s, e = time_simulate(wl, updates, chunks, engine)
            rows = [(engine, s, e)]
            if engine in HAND:
                rows.append((f"  hand-written {engine}", *hand[HAND[engine]]))
                hand_ratios.setdefault(engine, []).append(s / hand[HAND[engine]][0])
            for row, s, e in rows:
                steady.setdefault(row, []).append(s)
                e2e.setdefault(row, []).append(e)
                ratios.setdefault(row, []).append(s / floor)
                e2e_ratios.setdefault(row, []).append(e / floor_e2e)
    med = statistics.median
    out = {"floor": (med(steady["floor"]), 1.0, med(e2e["floor"]), 1.0)}
    for row in ratios:
        out[row] = (med(steady[row]), med(ratios[row]), med(e2e[row]), med(e2e_ratios[row]))
    print(f"[{name}: {num_params(wl['params']):,} parameters, batch {wl['batch_size']}, {updates} updates]")
    head = (
        f"  {'engine':36s} {'steady μs/update':>17s} {'ratio':>6s} {'÷ hand':>7s} {'end to end s':>13s} {'ratio':>6s}"
    )
    print(head)
    for row, (s, r, e, er) in out.items():
        by_hand = f"{med(hand_ratios[row]):7.2f}" if row in hand_ratios else " " * 7
        print(f"  {row:36s} {1e6 * s:17.1f} {r:6.2f} {by_hand} {e:13.2f} {er:6.2f}")
    print(flush=True)
    return out


# --------------------------------------------------------------------------------------------------------------------
# Sweeps: FLOP/s against the machine's matmul peak.
# --------------------------------------------------------------------------------------------------------------------


def matmul_peak(repeats: int = 10) -> float:
    """float32 GFLOP/s of one large matmul at JAX's default precision (the best of ``repeats``)."""
    n = 2048 if jax.default_backend() == "cpu" else 8192
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    mm = jax.jit(lambda x, y: x @ y)
    jax.block_until_ready(mm(a, a))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(mm(a, a))
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def flops_per_update(wl) -> float:
    """FLOPs of one minibatch gradient, from XLA's cost analysis."""
    batch = jax.tree.map(lambda a: a[: wl["batch_size"]], wl["data"])
    compiled = jax.jit(jax.grad(wl["loss"])).lower(wl["params"], batch).compile()
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list | tuple) else analysis
    return float(analysis["flops"])


def sweep_throughput(wl, updates: int, chunks: int, repeats: int) -> None:
    keys, hp = asgd_jax.grid(seeds=range(4), lam=[0.0, 0.5, 1.0, 2.0])
    runs = len(hp["lam"])
    flops = flops_per_update(wl)
    rows: dict[str, list[float]] = {}
    for _ in range(repeats):
        stamps: list[float] = []
        asgd_jax.sweep(
            wl["loss"],
            lambda h: asgd_jax.dc_asgd(LR, h["lam"], adaptive=True),
            wl["params"],
            wl["data"],
            asgd_jax.Plan(batch_size=wl["batch_size"], num_updates=updates, chunk=updates // chunks),
            keys=keys,
            hparams=hp,
            progress=False,
            callback=lambda done, st, stamps=stamps: (
                jax.block_until_ready(st.server.params),
                stamps.append(time.perf_counter()),
            ),
        )
        rows.setdefault("sweep", []).append((stamps[-1] - stamps[0]) / (updates - updates // chunks))
        rows.setdefault("floor x16 (vmap)", []).append(time_floor(wl, updates, chunks, runs=runs)[0])
        rows.setdefault("floor x1", []).append(time_floor(wl, updates, chunks)[0])
        rows.setdefault("peak", []).append(matmul_peak())
    peak = statistics.median(rows.pop("peak"))
    print(f"[16-run sweep (4 seeds x 4 lambdas, DC-ASGD-a, Workers(8)) on W, {updates} updates each]")
    print(
        f"  matmul peak (float32, default precision): {peak:.1f} GFLOP/s; "
        f"{flops / 1e6:.2f} MFLOP per update (XLA cost analysis)"
    )
    for name, values in rows.items():
        t = statistics.median(values)
        n = 1 if name == "floor x1" else runs
        gflops = n * flops / t / 1e9
        print(
            f"  {name:18s} {1e6 * t:9.1f} μs per step of all runs  {gflops:6.1f} GFLOP/s  {gflops / peak:6.1%} of peak"
        )
    print(flush=True)


# --------------------------------------------------------------------------------------------------------------------
# Memory versus M.
# --------------------------------------------------------------------------------------------------------------------


def memory_versus_workers(wl, worker_counts) -> None:
    rule = asgd_jax.dc_asgd(LR, 2.0, adaptive=True)
    p_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(wl["params"]))
    print(f"[memory vs M, W, DC-ASGD-a: parameters = {p_bytes / 1024:.0f} KiB]")
    print("     M   state KiB   state / params   XLA temp KiB")
    for m in worker_counts:
        lowered = asgd_jax.simulator.lower(
            wl["loss"],
            rule,
            wl["params"],
            wl["data"],
            asgd_jax.Plan(asgd_jax.delays.Workers(m), batch_size=wl["batch_size"], chunk=10),
        )
        state = lowered.args_info[0][0]  # the chunk's first argument: the whole simulator state
        state_bytes = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))
        temp = lowered.compile().memory_analysis().temp_size_in_bytes
        print(f"  {m:4d}   {state_bytes / 1024:9.0f}   {state_bytes / p_bytes:14.2f}   {temp / 1024:12.0f}")
    print(flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer updates and repeats")
    parser.add_argument("--only", nargs="+", default=None, help="W, L, cnn, sweep, memory")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every update count (e.g. 4 on a GPU)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 3, --quick 2)")
    args = parser.parse_args()
    repeats = args.repeats or (2 if args.quick else 3)
    scale = (2 if args.quick else 1) / args.scale
    parts = args.only or ["W", "L", "cnn", "sweep", "memory"]
    print(f"jax {jax.__version__} on {jax.default_backend()} ({jax.devices()[0].device_kind}), {repeats} repeats\n")
    w = mlp_workload((64, 256, 256, 10), 64)
    if "W" in parts:
        compare("W: MLP 64-256-256-10", w, int(3000 / scale), 10, repeats)
    if "L" in parts:
        compare("L: MLP 64-1024-1024-10", mlp_workload((64, 1024, 1024, 10), 64), int(600 / scale), 10, repeats)
    if "cnn" in parts:
        compare("cnn on mnist1d", cnn_workload(32), int(1200 / scale), 10, repeats)
    if "sweep" in parts:
        sweep_throughput(w, int(1000 / scale), 10, repeats)
    if "memory" in parts:
        memory_versus_workers(w, [1, 8, 32, 64])


if __name__ == "__main__":
    main()
