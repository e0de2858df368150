"""`asgd-jax train` as a user runs it, beside the plain jitted loop a user would write instead. Ratios, side by side.

The floor: one `jax.jit` optax SGD step of the same flax `cnn` on the same 8x8 digits and batch (32), looped on one
device (nothing of ours). The trainer: the CLI, `asgd-jax train --dataset digits --model cnn --rule asgd`, each run in
a process of its own with 8 fake CPU devices (one per worker) or one, its rate read from `summary.json` (updates/s
over the session's clock, which starts after the programs are compiled; the floor is timed after its compile too),
and the store's busy share from the same file. Configurations: 1, 2 and 4 workers at n_sync 1 (on 8 fake devices, a
worker each, and on one device, the default of a CPU machine, where the store computes every worker's pushes), and one
worker at n_sync 4 and 16 (`--push accumulate`: the summed gradients of n_sync minibatches at the pulled weights),
compared in minibatches/s.

    .venv/bin/python experiments/benchmarks/trainer_vs_loop.py                        # ~10 minutes on 2 cores
    .venv/bin/python experiments/benchmarks/trainer_vs_loop.py --steps 500 --reps 1   # shorter

This machine's speed drifts by a third within minutes: every run is timed beside a floor of its own, and the table
gives the median ratio with its range.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
import optax

import asgd_jax

BATCH = 32


def floor(steps: int) -> float:
    """Steps/s of a plain jitted optax SGD step of the cnn on digits (after its compile)."""
    ds = asgd_jax.data.load("digits")
    model = asgd_jax.models.get("cnn", num_classes=10, input_shape=ds.input_shape)
    params, _ = model.init(jax.random.key(0))
    opt = optax.sgd(0.1)

    @jax.jit
    def step(p, o, x, y):
        def loss(p):
            logits = model.module.apply({"params": p}, x, train=True)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        g = jax.grad(loss)(p)
        u, o = opt.update(g, o, p)
        return optax.apply_updates(p, u), o

    x, y = np.asarray(ds.x_train, np.float32), np.asarray(ds.y_train, np.int32)
    batches = [(x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]) for i in range(len(y) // BATCH)]
    p, o = params, opt.init(params)
    p, o = jax.block_until_ready(step(p, o, *batches[0]))
    t0 = time.perf_counter()
    for i in range(steps):
        p, o = step(p, o, *batches[i % len(batches)])
    jax.block_until_ready(p)
    return steps / (time.perf_counter() - t0)


def train(workers: int, n_sync: int, steps: int, devices: int = 8) -> dict:
    """One `asgd-jax train` run in a process of its own on ``devices`` CPU devices; its summary.json."""
    with tempfile.TemporaryDirectory() as out:
        flags = ["--dataset", "digits", "--model", "cnn", "--rule", "asgd", "--lr", "0.1", "--schedule", "constant"]
        flags += ["--workers", str(workers)]
        flags += ["--steps", str(steps), "--out", out, "--no-progress", "--eval-every", str(10 * steps)]
        if n_sync > 1:
            flags += ["--n-sync", str(n_sync), "--push", "accumulate"]
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
        cli = os.path.join(os.path.dirname(sys.executable), "asgd-jax")
        subprocess.run([cli, "train", *flags], check=True, env=env, capture_output=True)
        with open(os.path.join(out, "summary.json")) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000, help="server updates per run (n_sync 1)")
    parser.add_argument("--reps", type=int, default=3, help="runs of each configuration, each beside a floor")
    args = parser.parse_args()
    print(
        f"jax {jax.__version__}; floor: a plain jitted loop (cnn, digits, batch {BATCH}), timed right before each run"
    )
    print(f"medians of {args.reps} runs; each ratio is a run over the floor measured beside it")
    columns = ("workers", "devices", "n_sync", "updates/s", "minibatches/s", "÷ floor (minibatches)", "floor steps/s")
    print("| " + " | ".join((*columns, "store busy")) + " |")
    print("|---|---|---|---|---|---|---|---|")
    for workers, n_sync, devices in ((1, 1, 8), (2, 1, 8), (4, 1, 8), (2, 1, 1), (4, 1, 1), (1, 4, 8), (1, 16, 8)):
        steps = max(args.steps // n_sync, 50)
        rates, ratios, floors, busy = [], [], [], []
        for _ in range(args.reps):
            floors.append(floor(args.steps))
            s = train(workers, n_sync, steps, devices)
            rates.append(s["updates_per_second"])
            ratios.append(rates[-1] * n_sync / floors[-1])
            busy.append(s["store"]["busy"])
        rate = float(np.median(rates))
        print(
            f"| {workers} | {devices} | {n_sync} | {rate:,.1f} | {rate * n_sync:,.1f} | {np.median(ratios):.2f} "
            f"({min(ratios):.2f}-{max(ratios):.2f}) | {np.median(floors):,.1f} | {np.median(busy):.0%} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
