"""How much does simulating asynchrony cost over plain SGD? Ratios measured side by side in one run.

(a) ``asgd_jax.simulate`` with 8 event-driven workers and DC-ASGD-a,
(b) a plain ``lax.scan`` of sequential SGD steps: the same model, batch, data order and gradient work, no asynchrony
    (the floor),
(c) a Python loop over a jitted SGD step (what a hand-written loop does).
Targets: (a)/(b) <= 1.10 and (a) faster than (c). Also: a 16-run grid (4 seeds x 4 lambdas) as one ``sweep`` versus
16 separate ``simulate`` calls (wall time including compilation, as a user sees it), and the simulator's state and
XLA memory versus the number of workers M (it should grow as M x parameter size, nothing worse).

Steady-state times exclude compilation: every engine runs in the same chunks and the first chunk is discarded.

    .venv/bin/python experiments/benchmarks/simulator_overhead.py            # ~3 minutes on 2 cores
    .venv/bin/python experiments/benchmarks/simulator_overhead.py --quick    # ~1 minute
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import asgd_jax
from asgd_jax import order, simulator


def setup(model_name: str):
    ds = asgd_jax.data.load("mnist1d")
    model = asgd_jax.models.get(model_name, num_classes=10, input_shape=ds.input_shape)
    params, state = model.init(jax.random.key(0))
    return ds, model, params, state


def time_simulator(loss, params, state, ds, updates, chunks, delays, rule):
    stamps = []
    asgd_jax.simulate(
        loss, rule, params, ds.train, delays=delays, num_updates=updates, model_state=state,
        eval_every=updates // chunks, eval_fn=lambda p, s: {}, progress=False,
        callback=lambda done, st: (jax.block_until_ready(st.server.params), stamps.append(time.perf_counter())),
    )  # fmt: skip
    return (stamps[-1] - stamps[0]) / (updates - updates // chunks)


def make_sgd_step(loss, ds, batch_size, lr):
    rule = optax.sgd(lr)
    x, y = jnp.asarray(ds.x_train), jnp.asarray(ds.y_train)
    n = len(ds.y_train)
    per_epoch = n // batch_size
    key = jax.random.key(0)
    words = order.key_words(key)

    def step(carry, t):
        params, opt_state, model_state = carry
        epoch, k = t // per_epoch, t % per_epoch
        idx = order.example_index(words, epoch, k * batch_size + jnp.arange(batch_size), n)
        grads, (model_state, _) = jax.grad(loss, has_aux=True)(
            params, model_state, {"x": x[idx], "y": y[idx]}, jax.random.fold_in(key, t)
        )
        updates, opt_state = rule.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, model_state), None

    return step, rule


def time_scan(loss, params, state, ds, updates, chunks, batch_size):
    step, rule = make_sgd_step(loss, ds, batch_size, 0.1)
    length = updates // chunks

    @jax.jit
    def chunk(carry, start):
        carry, _ = jax.lax.scan(step, carry, start + jnp.arange(length))
        return carry

    carry = (params, rule.init(params), state)
    stamps = []
    for c in range(chunks):
        carry = jax.block_until_ready(chunk(carry, c * length))
        stamps.append(time.perf_counter())
    return (stamps[-1] - stamps[0]) / (updates - length)


def time_python_loop(loss, params, state, ds, updates, chunks, batch_size):
    step, rule = make_sgd_step(loss, ds, batch_size, 0.1)
    jstep = jax.jit(step)
    carry = (params, rule.init(params), state)
    carry, _ = jstep(carry, 0)  # compile
    jax.block_until_ready(carry)
    length = updates // chunks
    start = time.perf_counter()
    for t in range(length, updates):
        carry, _ = jstep(carry, t)
    jax.block_until_ready(carry)
    return (time.perf_counter() - start) / (updates - length)


def tree_bytes(tree) -> int:
    return sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def memory_versus_workers(loss, params, state, ds, worker_counts):
    rule = asgd_jax.dc_asgd(0.1, 2.0, adaptive=True)
    rows = []
    for m in worker_counts:
        delays = asgd_jax.delays.Workers(m)
        n = len(ds.y_train)
        cfg = simulator._Config("async", 1, "gradients", 32, n, n // m, True, 10)
        init = jax.jit(lambda k, delays=delays, cfg=cfg: simulator._init(rule, delays, cfg, params, state, k))
        sim_state = init(jax.random.key(0))
        grad_fn = jax.value_and_grad(simulator._as_stateful(loss, True), has_aux=True)
        chunk = simulator._make_chunk(grad_fn, lambda _: rule, lambda _, d=delays: d, cfg, None, 10)
        compiled = (
            jax.jit(chunk, donate_argnums=0)
            .lower(sim_state, jax.tree.map(jnp.asarray, ds.train), jax.random.key(0), {}, jnp.float32(0))
            .compile()
        )
        mem = compiled.memory_analysis()
        rows.append((m, tree_bytes(sim_state), getattr(mem, "temp_size_in_bytes", float("nan"))))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default=None, help="mlp or cnn (default: both)")
    args = parser.parse_args()
    updates, chunks, repeats = (1100, 11, 2) if args.quick else (3300, 11, 5)
    models = [args.model] if args.model else ["mlp", "cnn"]
    print(f"jax {jax.__version__} on {jax.default_backend()}, {jax.device_count()} device(s); {updates} updates\n")

    for model_name in models:
        ds, model, params, state = setup(model_name)
        loss = asgd_jax.classification_loss(model)
        rule = asgd_jax.dc_asgd(0.1, 2.0, adaptive=True)
        times = {"a": [], "a1": [], "b": [], "c": []}
        workers = asgd_jax.delays.Workers(8)
        for _ in range(repeats):  # interleaved, so drift on a shared machine hits all of them alike
            times["a"].append(time_simulator(loss, params, state, ds, updates, chunks, workers, rule))
            times["a1"].append(time_simulator(loss, params, state, ds, updates, chunks, workers, asgd_jax.asgd(0.1)))
            times["b"].append(time_scan(loss, params, state, ds, updates, chunks, 32))
            times["c"].append(time_python_loop(loss, params, state, ds, updates, chunks, 32))
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"[{model_name}: {model.num_params(params):,} params, batch 32, mnist1d]")
        print(f"  (a) simulator, 8 workers, DC-ASGD-a : {1e6 * med['a']:8.1f} us/update")
        print(f"  (a1) same, plain ASGD rule          : {1e6 * med['a1']:8.1f} us/update")
        print(f"  (b) lax.scan sequential SGD (floor) : {1e6 * med['b']:8.1f} us/update")
        print(f"  (c) Python loop of jitted SGD steps : {1e6 * med['c']:8.1f} us/update")
        print(f"  (a)/(b) = {med['a'] / med['b']:.2f}   (target <= 1.10)")
        print(
            f"  (a1)/(b) = {med['a1'] / med['b']:.2f}  (the asynchrony machinery alone, without DC-ASGD-a's arithmetic)"
        )
        print(f"  (c)/(a) = {med['c'] / med['a']:.2f}   (target > 1: the simulator beats a Python loop)\n")

    ds, model, params, state = setup("mlp")
    loss = asgd_jax.classification_loss(model)
    keys, hp = asgd_jax.grid(seeds=range(4), lam=[0.0, 0.5, 1.0, 2.0])
    sweep_updates = updates // 2
    start = time.perf_counter()
    swept = asgd_jax.sweep(
        loss, lambda h: asgd_jax.dc_asgd(0.1, h["lam"], adaptive=True), params, ds.train, keys=keys, hparams=hp,
        num_updates=sweep_updates, model_state=state, progress=False,
    )  # fmt: skip
    jax.block_until_ready(swept.params)
    t_sweep = time.perf_counter() - start
    start = time.perf_counter()
    for r in range(16):
        alone = asgd_jax.simulate(
            loss, asgd_jax.dc_asgd(0.1, float(hp["lam"][r]), adaptive=True), params, ds.train, key=keys[r],
            num_updates=sweep_updates, model_state=state, progress=False,
        )  # fmt: skip
        jax.block_until_ready(alone.params)
    t_separate = time.perf_counter() - start
    print(f"[16-run grid (4 seeds x 4 lambdas), mlp, {sweep_updates} updates each, wall time incl. compilation]")
    print(
        f"  one sweep: {t_sweep:6.1f} s   16 separate runs: {t_separate:6.1f} s   ratio {t_separate / t_sweep:.1f}x\n"
    )

    rows = memory_versus_workers(loss, params, state, ds, [1, 8, 32, 128])
    p_bytes = tree_bytes(params)
    print(f"[memory vs M, mlp: parameters = {p_bytes / 1024:.0f} KiB]")
    print("     M   state KiB   state / params   XLA temp KiB")
    for m, s_bytes, temp in rows:
        print(f"  {m:4d}   {s_bytes / 1024:9.0f}   {s_bytes / p_bytes:14.2f}   {temp / 1024:12.0f}")


if __name__ == "__main__":
    main()
