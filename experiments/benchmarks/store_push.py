"""One push through the parameter store beside its own exchange and the memory it must touch. Ratios, side by side.

The store is driven with precomputed packed payloads (no gradient is computed), on the host CPU device (the default
store device), M = 4 workers, at four sizes: the `cnn` (13,706 parameters, 8 leaves), ResNet-20 (269,722, 59 leaves),
and one-leaf models of 1.1M and 11.2M parameters; rules ASGD and DC-ASGD-a (one global MeanSquare, the paper's).

- store: ``ParameterStore.push(..., packed=True).result()`` from one thread, end to end (the payload's transfer to the
  store's device, the applier's gate, the exchange, the trace line, the answer back), median. The payload comes as a
  worker's does: host buffers 64-byte aligned, with its finite check made in the worker's program (``Checked``: its
  cost is the worker's).
- exchange: the store's own compiled exchange for such a payload (``StoreState.lower``), looped on its state, median;
  "checking exchange": the one for a payload that comes plain (a caller's, a round's mean), which checks it itself.
- floor: the passes over parameter memory that the step needs, timed as NumPy copies of that many bytes (a copy is
  two passes: a read and a write). ASGD: read g (its finite check), read w, write w, write the worker's backup row,
  write the answer: 5 passes. DC-ASGD-a adds reading the backup and MeanSquare and writing MeanSquare: 8.
- plain JAX: the same job as a user writes it without this project (plain jax/optax, the model's pytree as it is):
  one jitted step, its state donated, that applies the rule (``optax.sgd``; DC-ASGD-a's compensation by hand, one
  MeanSquare), writes the worker's backup row and returns the fresh weights; no finite checks. What XLA makes of the
  step on this device, which the NumPy floor does not see (per-program and per-kernel costs).
- 4 threads: pushes/s with four threads pushing at once, against 1 / (exchange time).
- one pass: the last table, one elementwise pass in place at each size, XLA:CPU's (jitted, donated) beside NumPy's:
  what an exchange's own passes cost beside the floor's.
- pipelined store: the trainer's in-process path (``ParameterStore(pipelined=True)``, what a threads run of the
  plain asynchronous discipline uses): the payload already on the store's device, the answer waited for on the
  device; one thread's median push, and four threads' pushes/s against 1 / (exchange time).

    .venv/bin/python experiments/benchmarks/store_push.py            # ~2 minutes on 2 cores
    .venv/bin/python experiments/benchmarks/store_push.py --quick    # fewer pushes, no 11M model
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import asgd_jax
from asgd_jax import packing
from asgd_jax.trainer.messages import Checked
from asgd_jax.trainer.store import ParameterStore

WORKERS = 4
RULES = os.environ.get("RULES", "asgd dc_asgd_a").split()
PASSES = {"asgd": 5, "dc_asgd_a": 8}


def models(quick: bool) -> dict[str, object]:
    cnn = asgd_jax.models.get("cnn", num_classes=10, input_shape=(8, 8, 1))
    resnet = asgd_jax.models.get("resnet20", num_classes=10, input_shape=(32, 32, 3))
    out = {
        "cnn": cnn.init(jax.random.key(0))[0],
        "resnet20": resnet.init(jax.random.key(0))[0],
        "1.1M": {"w": np.zeros(1_124_352, np.float32)},
    }
    if not quick:
        out["11M"] = {"w": np.zeros(11_173_962, np.float32)}
    return out


def median_us(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def aligned_full(size: int, dtype) -> np.ndarray:
    """A payload buffer on the host as a worker's comes (a view of its device buffer, or out of Ray's object store):
    64-byte aligned, which a CPU device takes without a copy (NumPy's own large arrays are not: see
    ``asgd_jax.packing.aligned_empty``)."""
    x = packing.aligned_empty(size, dtype)
    x[...] = 1e-3
    return x


def floor_us(size: int, passes: int, n: int) -> float:
    a, b = np.ones(size, np.float32), np.empty(size, np.float32)
    return median_us(lambda: np.copyto(b, a), n) * passes / 2


def one_pass(size: int, n: int) -> tuple[float, float]:
    """One elementwise pass over ``size`` floats, in place: ``x * 0.5`` jitted with its input donated, and NumPy's
    ``np.multiply(a, 0.5, out=a)`` (median microseconds): what XLA:CPU's loops cost beside the floor's NumPy."""
    scale = jax.jit(lambda x: x * 0.5, donate_argnums=0)
    state = [jnp.ones(size, jnp.float32)]

    def xla() -> None:
        state[0] = scale(state[0])
        state[0].block_until_ready()

    xla()
    a = np.ones(size, np.float32)
    return median_us(xla, n), median_us(lambda: np.multiply(a, 0.5, out=a), n)


def plain_jax_us(params, rule_name: str, n: int) -> float:
    """The plain-JAX step (see the module's docstring), looped on its donated state: median microseconds."""
    lr, lam, decay, eps = 1e-3, 2.0, 0.95, 1e-7
    opt = optax.sgd(lr)
    params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)  # (donated: not the caller's arrays)
    backups = jax.tree.map(lambda x: jnp.zeros((WORKERS, *x.shape), x.dtype), params)
    mean_square = jax.tree.map(jnp.zeros_like, params)

    def step(p, opt_state, ms, b, g, w):
        if rule_name == "dc_asgd_a":  # g + lam / sqrt(ms + eps) * g * g * (w_t - w_bak(m)), ms the mean of g * g
            ms = jax.tree.map(lambda m, x: decay * m + (1 - decay) * x * x, ms, g)
            stale = jax.tree.map(lambda stack: stack[w], b)
            g = jax.tree.map(lambda x, m, w_, s: x + lam / jnp.sqrt(m + eps) * x * x * (w_ - s), g, ms, p, stale)
        updates, opt_state = opt.update(g, opt_state, p)
        p = optax.apply_updates(p, updates)
        b = jax.tree.map(lambda stack, x: stack.at[w].set(x), b, p)
        return p, opt_state, ms, b, p  # (the answer: the fresh weights, a buffer of their own)

    jitted = jax.jit(step, donate_argnums=(0, 1, 2, 3))
    g = jax.tree.map(lambda x: jnp.full(x.shape, 1e-3, x.dtype), params)
    state = [params, opt.init(params), mean_square, backups]
    worker = jnp.int32(0)

    def one() -> None:
        out = jitted(*state, g, worker)
        state[:] = out[:4]
        jax.block_until_ready(out)

    one()
    return median_us(one, n)


def threads_rate(push, n: int) -> float:
    """Pushes/s with ``WORKERS`` threads each pushing ``n`` times at once (thread w as worker w)."""
    threads = [threading.Thread(target=lambda w=w: [push(w) for _ in range(n)]) for w in range(WORKERS)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return WORKERS * n / (time.perf_counter() - t0)


def measure(params, rule_name: str, n: int) -> dict[str, float]:
    rule = asgd_jax.rules.get(rule_name, 1e-3)
    with tempfile.TemporaryDirectory() as out:
        store = ParameterStore(rule, params, WORKERS, out_dir=out)
        store.warm_up()
        store.warm_up(checked=True)
        payload = tuple(aligned_full(k, d) for k, d in zip(store.layout.sizes, store.layout.dtypes, strict=True))
        checked = Checked(payload, np.bool_(True))  # (a worker's push: its check made in its own program)
        version = [0]

        def push(worker: int = 0) -> None:
            _, _, version[0] = store.push(worker, checked, version[0], packed=True).result()

        push()
        one = median_us(push, n)
        store.state()  # (settled: nothing in flight)
        g = jax.device_put(payload, store.device)
        worker = jax.device_put(np.int32(0), store.device)
        flag = jax.device_put(np.bool_(True), store.device)

        def exchange_us(pushed, ok) -> float:
            compiled = store.server.lower(0, pushed, ()).compile()
            state = [jax.device_put(jax.device_get(store.server.stored), store.device)]  # a copy, in the stored form

            def one_exchange() -> None:
                out = compiled(state[0], store.server.numbers, worker, g, (), ok)
                state[0] = out[0]
                jax.block_until_ready(out)

            one_exchange()
            return median_us(one_exchange, n)

        alone, checking = exchange_us(checked, flag), exchange_us(payload, None)
        rate = threads_rate(push, n)
        store.close()
    size = sum(int(np.size(x)) for x in jax.tree.leaves(params))
    piped, piped_rate = pipelined(rule, params, n)
    floor = floor_us(size, PASSES[rule_name], n)
    plain = plain_jax_us(params, rule_name, n)
    return {
        "store": one,
        "exchange": alone,
        "checking": checking,
        "floor": floor,
        "plain": plain,
        "rate": rate,
        "piped": piped,
        "piped_rate": piped_rate,
    }


def pipelined(rule, params, n: int) -> tuple[float, float]:
    """The trainer's in-process path: a pipelined store, payloads already on its device, each push's answer waited
    for on the device (one thread: the median push; four threads: pushes/s)."""
    with tempfile.TemporaryDirectory() as out:
        store = ParameterStore(rule, params, WORKERS, out_dir=out, pipelined=True)
        store.warm_up(checked=True)
        sizes = zip(store.layout.sizes, store.layout.dtypes, strict=True)
        payload = jax.device_put(tuple(np.full(k, 1e-3, d) for k, d in sizes), store.device)
        checked = Checked(payload, jax.device_put(np.bool_(True), store.device))

        def push(worker: int = 0) -> None:
            jax.block_until_ready(store.push(worker, checked, 0, packed=True).result())

        push()
        one = median_us(push, n)
        rate = threads_rate(push, n)
        store.close()
    return one, rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer pushes, no 11M model")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, store on {jax.devices('cpu')[0]}, M = {WORKERS}; times are medians in us")
    print(
        "| params (leaves) | rule | store | exchange | checking exchange | floor | plain JAX | store ÷ exchange "
        "| exchange ÷ floor "
        "| exchange ÷ plain JAX | 4 threads ÷ 1/exchange | pipelined store | pipelined ÷ exchange "
        "| 4 threads pipelined ÷ 1/exchange |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    passes: list[tuple[int, float, float]] = []
    for name, params in models(args.quick).items():
        size, leaves = sum(int(np.size(x)) for x in jax.tree.leaves(params)), len(jax.tree.leaves(params))
        n = 20 if size > 5e6 else (50 if args.quick else 200)
        passes.append((size, *one_pass(size, 5 * n)))
        for rule_name in RULES:
            r = measure(params, rule_name, n)
            print(
                f"| {size:,} ({leaves}, {name}) | {rule_name} | {r['store']:,.0f} | {r['exchange']:,.0f} | "
                f"{r['checking']:,.0f} | "
                f"{r['floor']:,.0f} | {r['plain']:,.0f} | {r['store'] / r['exchange']:.2f} | "
                f"{r['exchange'] / r['floor']:.2f} | {r['exchange'] / r['plain']:.2f} | "
                f"{r['rate'] * r['exchange'] / 1e6:.2f} | {r['piped']:,.0f} | {r['piped'] / r['exchange']:.2f} | "
                f"{r['piped_rate'] * r['exchange'] / 1e6:.2f} |",
                flush=True,
            )
    print("\nOne elementwise pass in place (x * 0.5), median us: XLA:CPU, jitted and donated, beside NumPy")
    print("| params | XLA | NumPy | XLA ÷ NumPy |\n|---|---|---|---|")
    for size, xla, numpy in passes:
        print(f"| {size:,} | {xla:,.0f} | {numpy:,.0f} | {xla / numpy:.2f} |")


if __name__ == "__main__":
    main()
