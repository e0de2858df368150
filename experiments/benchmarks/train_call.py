"""What a notebook user waits for: one ``asgd_jax.train`` call end to end, compilation included, and a second one.

A user tunes the trainer in a notebook: a run, then another at another learning rate. The floor is what that user
writes without this project: a plain jitted optax SGD step of the same model and batch, the learning rate an argument
(a second loop at another rate compiles nothing), looped on one device. Against it, ``asgd_jax.train`` (the threads
backend, two workers on one CPU device, DC-ASGD-a, batch 32, no evaluation) as a user calls it:

* first call: nothing compiled in this process (the in-process programs forgotten, the persistent cache off);
* second call: another learning rate, the same structure (its programs kept: nothing compiled).

Each figure is the median of interleaved repeats, in seconds, with the second call as a ratio to the floor's second
loop of the same number of updates, measured in the same repeat, at two model sizes on the embedded digits: the
``mlp`` (64-256-256-10, 85k parameters) and the ``cnn``.

    .venv/bin/python experiments/benchmarks/train_call.py                 # ~40 s on 2 cores
    .venv/bin/python experiments/benchmarks/train_call.py --repeats 1
"""

from __future__ import annotations

import os

os.environ["ASGD_JAX_CACHE_DIR"] = "off"  # a first call compiles: no persistent cache
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)

import argparse
import statistics
import tempfile
import time

import jax
import numpy as np
import optax

import asgd_jax

BATCH = 32


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def floor(name: str, updates: int) -> tuple[float, float]:
    """A plain jitted optax loop: its first loop (compile included) and a second at another learning rate, seconds."""
    ds = asgd_jax.data.load("digits")
    model = asgd_jax.models.get(name, num_classes=10, input_shape=ds.input_shape)
    x, y = np.asarray(ds.x_train, np.float32), np.asarray(ds.y_train, np.int32)
    batches = [(x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]) for i in range(len(y) // BATCH)]

    @jax.jit
    def step(p, lr, x, y):
        def loss(p):
            logits = model.module.apply({"params": p}, x, train=True)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        u, _ = optax.sgd(lr).update(jax.grad(loss)(p), optax.sgd(lr).init(p), p)  # (lr traced: an argument)
        return optax.apply_updates(p, u)

    def loop(lr: float) -> None:
        p = model.init(jax.random.key(0))[0]
        for i in range(updates):
            p = step(p, np.float32(lr), *batches[i % len(batches)])
        jax.block_until_ready(p)

    return timed(lambda: loop(0.1)), timed(lambda: loop(0.05))


def train(name: str, updates: int, lr: float) -> float:
    ds = asgd_jax.data.load("digits")
    model = asgd_jax.models.get(name, num_classes=10, input_shape=ds.input_shape)

    def call() -> None:
        params, model_state = model.init(jax.random.key(0))
        with tempfile.TemporaryDirectory() as out:
            config = asgd_jax.TrainConfig(
                asgd_jax.Plan(2, num_updates=updates, batch_size=BATCH), out=out, progress=False
            )
            loss = asgd_jax.classification_loss(model)
            rule = asgd_jax.dc_asgd(lr, 2.0, adaptive=True)
            asgd_jax.train(loss, rule, params, ds.train, config, model_state=model_state)

    return timed(call)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--updates", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"jax {jax.__version__}; {args.updates} updates a call; medians of {args.repeats} repeats (seconds)")
    print("| model | floor: first loop | floor: second | train: first call | train: second call | second ÷ floor's |")
    print("|---|---|---|---|---|---|")
    for name in ("mlp", "cnn"):
        rows = []
        for _ in range(args.repeats):
            jax.clear_caches()
            getattr(asgd_jax.trainer, "clear_cache", lambda: None)()  # (absent before f5289a9)
            first, second = floor(name, args.updates)
            t1 = train(name, args.updates, 0.1)
            t2 = train(name, args.updates, 0.05)
            rows.append((first, second, t1, t2, t2 / second))
        m = [statistics.median(c) for c in zip(*rows, strict=True)]
        r = [c[4] for c in rows]
        print(
            f"| {name} | {m[0]:.2f} | {m[1]:.2f} | {m[2]:.2f} | {m[3]:.2f} | {m[4]:.2f} ({min(r):.2f}-{max(r):.2f}) |",
            flush=True,
        )


if __name__ == "__main__":
    main()
