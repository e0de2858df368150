"""A sweep's throughput in runs x updates per second, on one device and split over every device, and what that makes
of the staleness leaderboard's full form: hours per device count.

The workload is a study arm's: DC-ASGD-a, ``Workers(16)``, 16 runs of the `cnn` (batch 32 of 8x8 random pixels, the
digits' size) or of ResNet-20 (batch 128 of 32x32x3, CIFAR-10's). Each sweep is called twice and the second call
timed (its programs compiled by the first). From the measured runs x updates/s on all devices, the leaderboard's
full form (``asgd-jax run staleness_leaderboard``: every rule x M in {4, 16, 32} x three clusters x a learning-rate
grid x 5 seeds, CIFAR-10 ResNet-20, counted from the study's own arms) is estimated in hours.

    .venv/bin/python experiments/benchmarks/sweep_throughput.py                  # a GPU machine: every GPU
    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python experiments/benchmarks/sweep_throughput.py \\
        --quick --models cnn                                                     # the CPU check (~3 minutes)

On a CPU the fake devices share the same cores: the split there shows that the sharded program runs, not a speed-up.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np

import asgd_jax
from asgd_jax import studies

CIFAR10_TRAIN = 50_000
RULE = lambda h: asgd_jax.dc_asgd(0.05, h["lam"], adaptive=True)  # made once: every sweep of it shares its programs


def workload(name: str):
    rng = np.random.default_rng(0)
    batch, shape = (128, (32, 32, 3)) if name == "resnet20" else (32, (8, 8, 1))  # the cnn at the digits' size
    x = rng.normal(size=(4096, *shape)).astype(np.float32)
    y = rng.integers(0, 10, size=4096).astype(np.int32)
    model = asgd_jax.models.get(name, num_classes=10, input_shape=shape)
    params, state = model.init(jax.random.key(0))
    return model, params, state, {"x": x, "y": y}, batch


def throughput(name: str, devices: list, updates: int, runs: int = 16) -> float:
    """Runs x updates per second of a second sweep call (compilation excluded)."""
    model, params, state, data, batch = workload(name)
    keys, hp = asgd_jax.grid(seeds=list(range(runs // 4)), lam=[0.5, 1.0, 2.0, 4.0])
    plan = asgd_jax.Plan(asgd_jax.delays.Workers(16), batch_size=batch, num_updates=updates)
    call = lambda: asgd_jax.sweep(
        asgd_jax.classification_loss(model),
        RULE,
        params,
        data,
        plan,
        keys=keys,
        hparams=hp,
        model_state=state,
        progress=False,
        devices=devices,
    )
    jax.block_until_ready(call().params)
    t0 = time.perf_counter()
    jax.block_until_ready(call().params)
    return runs * updates / (time.perf_counter() - t0)


def leaderboard_work() -> tuple[int, int]:
    """The leaderboard full form's runs and runs x updates, counted from its arms (CIFAR-10's 50,000 examples)."""
    study = studies.load("staleness_leaderboard")
    s = study.full
    runs = work = 0
    for arm in study.arms(s, False):
        p = arm.plan
        per_update = s.batch_size * p.n_sync * (p.workers if p.mode == "sync" else 1)
        interval = max(1, round(s.epochs * CIFAR10_TRAIN / per_update / s.evals))
        n = len(arm.variants) * len(s.seeds)
        runs, work = runs + n, work + n * interval * s.evals
    return runs, work


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer updates")
    parser.add_argument("--models", nargs="+", default=["cnn", "resnet20"])
    args = parser.parse_args()
    devices = jax.devices()
    print(f"jax {jax.__version__}, {len(devices)} {devices[0].platform} device(s)")
    runs, work = leaderboard_work()
    print(f"staleness_leaderboard full form: {runs:,} runs, {work / 1e6:,.1f}M run-updates (ResNet-20, batch 128)")
    for name in args.models:
        updates = (20 if name == "resnet20" else 100) if args.quick else (200 if name == "resnet20" else 1000)
        one = throughput(name, devices[:1], updates)
        every = throughput(name, devices, updates) if len(devices) > 1 else one
        print(
            f"\n{name}: 16 runs x {updates} updates: one device {one:,.1f} run-updates/s, {len(devices)} devices "
            f"{every:,.1f} ({every / one:.2f}x)"
        )
        if name == "resnet20":
            for count in sorted({1, len(devices)}):
                rate = one if count == 1 else every
                print(f"  leaderboard full form on {count} device(s): {work / rate / 3600:,.1f} hours")


if __name__ == "__main__":
    main()
