"""The threaded trainer on several devices: store overhead, stragglers, scaling. Ratios measured side by side.

(a) Store overhead: the fraction of worker time spent outside gradient computation (data, host copies, waiting for
    the store to apply the push and hand back fresh weights) at n_sync = 1. Target <= 10%.
(b) Stragglers: one worker slowed 4x; asynchronous updates (and minibatches) per second relative to SSGD
    (``mode="sync"``) on the same devices. Target >= 2x.
(c) Updates per second of the asynchronous trainer with 1, 2 and 4 workers.

A model large enough that compute dominates: an MLP 40-1024-1024-10 (1.1M parameters) on mnist1d, batch 256 per
worker, DC-ASGD-a (per-worker MeanSquare, the heaviest rule) and, to separate the rule's own arithmetic from the
store's machinery, plain ASGD. Every configuration runs after a warm-up (the trainer compiles before its clock
starts) and the configurations are interleaved over the repeats; medians are reported.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 .venv/bin/python experiments/benchmarks/trainer_overhead.py
    ... trainer_overhead.py --quick       # fewer updates and repeats (~1 minute on 2 cores)

On a GPU machine, run it as is: it uses the first 4 devices JAX sees (fewer if there are fewer).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax
import jax.numpy as jnp
import numpy as np

import asgd_jax
from asgd_jax.plan import Plan
from asgd_jax.trainer import TrainConfig, train

HIDDEN = 1024
BATCH = 256


def make_problem():
    ds = asgd_jax.data.load("mnist1d")
    rng = np.random.default_rng(0)
    dims = [int(np.prod(ds.x_train.shape[1:])), HIDDEN, HIDDEN, 10]
    params = [
        {"w": (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32), "b": np.zeros(b, np.float32)}
        for a, b in itertools.pairwise(dims)
    ]

    def loss(params, batch):
        h = batch["x"].reshape(batch["x"].shape[0], -1)
        for layer in params[:-1]:
            h = jax.nn.relu(h @ layer["w"] + layer["b"])
        logits = h @ params[-1]["w"] + params[-1]["b"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][:, None], axis=1))

    data = {"x": ds.x_train.reshape(len(ds.x_train), -1).astype(np.float32), "y": ds.y_train.astype(np.int32)}
    return loss, params, data


def run(loss, params, data, devices, *, workers, steps, mode="async", slowdown=None, rule="dc_asgd_a", batch=BATCH):
    rule = asgd_jax.asgd(0.05) if rule == "asgd" else asgd_jax.dc_asgd(0.05, 2.0, adaptive=True, num_workers=workers)
    config = TrainConfig(
        Plan(workers, num_updates=steps, batch_size=batch, mode=mode), slowdown=slowdown or {}, seed=0, progress=False
    )
    result = train(loss, rule, params, data, config, devices=devices)
    assert result.pushes_applied == steps and not result.failures
    minibatches = sum(w.pushes for w in result.workers)
    overhead = statistics.mean(w.overhead for w in result.workers)
    return steps / result.seconds, minibatches / result.seconds, overhead


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--batch-size", type=int, default=BATCH, help="per worker; the store's cost does not grow with it"
    )
    args = parser.parse_args()
    repeats = args.repeats or (2 if args.quick else 3)
    steps = 60 if args.quick else 200
    devices = jax.devices()[:4]
    n = len(devices)
    loss, params, data = make_problem()
    print(
        f"{n} x {devices[0].platform} devices, {sum(x.size for p in params for x in p.values()):,} params, batch "
        f"{args.batch_size} per worker, {steps} updates per run, {repeats} repeats (medians)"
    )
    configs = {
        **{f"async x{m}": dict(workers=m) for m in (1, 2, 4) if m <= n},
        **{f"async x{m}, ASGD rule": dict(workers=m, rule="asgd") for m in (1, n)},
        f"async x{n}, worker 0 4x slower": dict(workers=n, slowdown={0: 4.0}),
        f"sync x{n}, worker 0 4x slower": dict(workers=n, mode="sync", slowdown={0: 4.0}, steps=max(steps // n, 10)),
    }
    samples: dict[str, list[tuple[float, float, float]]] = {k: [] for k in configs}
    for _ in range(repeats):
        for name, cfg in configs.items():
            cfg = {"steps": steps, "batch": args.batch_size, **cfg}
            samples[name].append(run(loss, params, data, devices, **cfg))
    med = {k: tuple(statistics.median(s[i] for s in v) for i in range(3)) for k, v in samples.items()}
    print("\n| configuration | updates/s | minibatches/s | worker time outside compute |\n|---|---|---|---|")
    for name, (ups, mbs, overhead) in med.items():
        print(f"| {name} | {ups:.1f} | {mbs:.1f} | {100 * overhead:.1f}% |")
    slow_a, slow_s = med[f"async x{n}, worker 0 4x slower"], med[f"sync x{n}, worker 0 4x slower"]
    print(
        f"\n(a) store overhead at n_sync=1: async x1 {100 * med['async x1'][2]:.1f}%, x{n} "
        f"{100 * med[f'async x{n}'][2]:.1f}%; with the ASGD rule x1 {100 * med['async x1, ASGD rule'][2]:.1f}%, "
        f"x{n} {100 * med[f'async x{n}, ASGD rule'][2]:.1f}% (target <= 10%)"
    )
    print(
        f"(b) straggler, async / sync: {slow_a[0] / slow_s[0]:.2f}x updates/s, {slow_a[1] / slow_s[1]:.2f}x "
        "minibatches/s (target >= 2x)"
    )
    base = med["async x1"][0]
    print(
        "(c) updates/s relative to 1 worker: "
        + ", ".join(f"x{m}: {med[f'async x{m}'][0] / base:.2f}" for m in (1, 2, 4) if m <= n)
    )


if __name__ == "__main__":
    main()
