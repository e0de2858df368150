"""The trainer's throughput: updates/s with 1, 2 and 4 workers beside the floor, and what one push costs the store.

Two model sizes by default, the `cnn` (13,706 parameters on 8x8 inputs) and ResNet-20 (269,722 on 32x32x3, CIFAR-10's
size; `convnet` too on request), batch 32 per worker (`--batch`), DC-ASGD-a (per-worker MeanSquare, the heaviest
rule), on the devices JAX sees (8 fake CPU devices here: each worker owns one), with the store's state on the host
(`--store-devices cpu gpu` for both placements on a GPU machine). Measured side by side in one process:

- floor: what a user writes without this project: one `jax.jit` SGD step of the same model and batch (plain optax),
  called in a loop on one device: steps/s.
- trainer xM: `asgd_jax.train` with M worker threads, updates/s over the run (the trainer compiles before its clock
  starts), and its ratio to the floor.
- store: one push through the `ParameterStore` end to end (validation, host-to-device copy, the jitted exchange, the
  trace, the host copy of the fresh weights back), beside the jitted exchange alone, in milliseconds.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python experiments/benchmarks/trainer_throughput.py
    ... trainer_throughput.py --quick      # fewer updates (~3 minutes on 2 cores)

On a GPU machine (gpu_check.sh): `--quick --models resnet20 convnet --batch 128 --workers 1 2 4 8 --store-devices cpu
gpu`, one worker per GPU. The last line of each model states the store's ceiling (pushes/s) against one device's step
rate: with M workers the trainer reaches at most min(M, ceiling / floor) x the floor. With more workers than devices the
workers share them (worker w on device w mod D): on a one-GPU machine x2..x8 measure the store and the host's threads
against one GPU's work, not a scaling over GPUs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
import optax

import asgd_jax
from asgd_jax.plan import Plan
from asgd_jax.trainer import TrainConfig, train
from asgd_jax.trainer.messages import Checked
from asgd_jax.trainer.store import ParameterStore

BATCH = 32  # per worker (--batch)


def problem(name: str):
    rng = np.random.default_rng(0)
    if name == "cnn":
        ds = asgd_jax.data.load("digits")
        x, y, shape = ds.x_train, ds.y_train, ds.input_shape
    else:  # CIFAR-10's shapes, random pixels: throughput does not depend on what the pixels are
        x = rng.normal(size=(2048, 32, 32, 3)).astype(np.float32)
        y = rng.integers(0, 10, size=2048).astype(np.int32)
        shape = (32, 32, 3)
    model = asgd_jax.models.get(name, num_classes=10, input_shape=shape)
    params, state = model.init(jax.random.key(0))
    return model, params, state, {"x": x, "y": y}


def floor(model, params, state, data, steps: int) -> float:
    """Steps/s of a plain jitted optax SGD step (nothing of ours but the flax module)."""
    opt = optax.sgd(0.05)

    def loss(p, s, b, key):
        rngs = {"dropout": key}  # the convnet's dropout (the others ignore it)
        if s:
            logits, s = model.module.apply({"params": p, **s}, b["x"], train=True, mutable=list(s), rngs=rngs)
        else:
            logits = model.module.apply({"params": p}, b["x"], train=True, rngs=rngs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean(), s

    @jax.jit
    def step(p, o, s, b, key, i):  # (the step's key folded in the program, as the trainer's workers do)
        (_, s), g = jax.value_and_grad(loss, has_aux=True)(p, s, b, jax.random.fold_in(key, i))
        u, o = opt.update(g, o, p)
        return optax.apply_updates(p, u), o, s

    n = len(data["y"])
    batches = [{k: v[i * BATCH % n : i * BATCH % n + BATCH] for k, v in data.items()} for i in range(8)]
    p, o, s = params, opt.init(params), state
    key = jax.random.key(1)
    p, o, s = jax.block_until_ready(step(p, o, s, batches[0], key, 0))  # compiled before the clock
    t0 = time.perf_counter()
    for i in range(steps):
        p, o, s = step(p, o, s, batches[i % 8], key, i)
    jax.block_until_ready(p)
    return steps / (time.perf_counter() - t0)


def trainer(model, params, state, data, workers: int, updates: int, store_device: str = "cpu") -> float:
    plan = Plan(workers, num_updates=updates, batch_size=BATCH)
    config = TrainConfig(plan, progress=False, store_device=store_device)
    result = train(
        asgd_jax.classification_loss(model),
        asgd_jax.rules.get("dc_asgd_a", 0.05),
        params,
        data,
        config,
        model_state=state,
        devices=jax.devices()[: max(workers, 1)],
    )
    return result.pushes_applied / result.seconds


def store_push(params, state, pushes: int, store_device: str = "cpu") -> tuple[float, float]:
    """Milliseconds per push through the store, and for its jitted exchange alone (median of ``pushes``)."""
    rule = asgd_jax.rules.get("dc_asgd_a", 0.05)
    device = TrainConfig(store_device=store_device).store_device_now()
    with tempfile.TemporaryDirectory() as out:
        store = ParameterStore(rule, params, 4, model_state=state, out_dir=out, device=device)
        store.warm_up(checked=True)
        grads = jax.tree.map(lambda x: np.full(x.shape, 1e-3, np.float32), params)
        payload, model_state = store.layout.pack_host(grads), store.model_state_layout.pack_host(state)
        checked = Checked(payload, np.bool_(True))  # (as a worker pushes it: its finite check made in its program)
        whole = []
        for i in range(pushes):
            t0 = time.perf_counter()
            store.push(i % 4, checked, i, model_state, packed=True).result()
            whole.append(time.perf_counter() - t0)
        compiled = store.server.lower(0, checked, model_state).compile()
        args = jax.device_put((np.int32(0), payload, model_state, np.bool_(True)), store.device)
        store.state()  # (settled: nothing in flight)
        live = jax.device_put(jax.device_get(store.server.stored), store.device)  # a copy, looped as the store does
        alone = []
        for _ in range(pushes):
            t0 = time.perf_counter()
            out = compiled(live, store.server.numbers, *args)
            jax.block_until_ready(out)
            live = out[0]
            alone.append(time.perf_counter() - t0)
        store.close()
    return 1e3 * statistics.median(whole), 1e3 * statistics.median(alone)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer updates")
    parser.add_argument("--models", nargs="+", default=["cnn", "resnet20"], choices=["cnn", "resnet20", "convnet"])
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2, 4], help="worker counts (one device each)")
    parser.add_argument("--batch", type=int, default=BATCH, help="minibatch per worker")
    parser.add_argument("--store-devices", nargs="+", default=["cpu"], help="where the store keeps its state")
    parser.add_argument("--steps", type=int, default=None, help="updates per worker count (default by model size)")
    args = parser.parse_args()
    globals()["BATCH"] = args.batch
    print(
        f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} device(s), batch {BATCH}, DC-ASGD-a"
    )
    for name in args.models:
        model, params, state, data = problem(name)
        size = sum(int(np.size(x)) for x in jax.tree.leaves(params))
        small = name == "cnn"
        steps = args.steps or ((400 if small else 24) if args.quick else (2000 if small else 80))
        base = floor(model, params, state, data, steps)
        print(f"\n{name} ({size:,} parameters): floor {base:.1f} steps/s")
        for where in args.store_devices:
            for workers in args.workers:
                rate = trainer(model, params, state, data, workers, steps * max(1, workers // 2), where)
                shared = f" on {jax.device_count()} device(s)" if workers > jax.device_count() else ""
                print(
                    f"  store on {where}, trainer x{workers}{shared}: {rate:.1f} updates/s  ({rate / base:.2f} x floor)"
                )
            whole, alone = store_push(params, state, 50 if args.quick else 200, where)
            print(
                f"  store on {where}: one push {whole:.2f} ms (the jitted exchange alone {alone:.2f} ms): its ceiling "
                f"{1e3 / whole:.0f} pushes/s = {1e3 / whole / base:.2f} x one device's step rate"
            )


if __name__ == "__main__":
    main()
