"""What a per-worker table costs inside ``rules.one_of`` under a batched index: a sweep of 12 runs (3 seeds x 4
learning rates) of MNIST-1D's MLP on ``Workers(n)``, per update, side by side in one process:

* ``asgd``: plain ASGD (no table), the floor of this comparison;
* ``ia2sgd``: IA²SGD alone (an n-row table, one row read and written per update);
* ``one_of, fixed``: ``one_of(0, [asgd, ia2sgd])``, the index a constant (the chosen branch only);
* ``one_of, batched``: ``one_of(lr > 0.15, [asgd, ia2sgd])``, the index differing across the sweep's runs, as a study
  arm mixing rules has it: every choice computed and its whole state selected.

at n = 4, 16 and 64 and two model sizes (the MLP's default 23,050 parameters, and ``hidden=(512, 512)``, 287k). "first
call" is the sweep's first call (compilation included), "steady" the second one's time per update.

    .venv/bin/python experiments/benchmarks/one_of_tables.py          # ~8 minutes on 2 cores
"""

import time

import jax
import jax.numpy as jnp

import asgd_jax
from asgd_jax import delays, rules

UPDATES = 600


def _sweep(loss, rule, params, state, data, m):
    plan = asgd_jax.Plan(delays.Workers(m), num_updates=UPDATES, batch_size=32)
    keys, hp = asgd_jax.grid(seeds=range(3), lr=[0.05, 0.1, 0.2, 0.4])
    run = lambda: asgd_jax.sweep(
        loss, rule, params, data, plan, keys=keys, hparams=hp, model_state=state, progress=False
    )
    t = time.perf_counter()
    jax.block_until_ready(run().params)
    first = time.perf_counter() - t
    t = time.perf_counter()
    jax.block_until_ready(run().params)
    return first, (time.perf_counter() - t) / UPDATES * 1e3


def main() -> None:
    ds = asgd_jax.data.load("mnist1d")
    for options in ({}, {"hidden": (512, 512)}):
        model = asgd_jax.models.get("mlp", num_classes=10, input_shape=ds.input_shape, **options)
        params, state = model.init(jax.random.key(0))
        loss = asgd_jax.classification_loss(model)
        size = sum(x.size for x in jax.tree.leaves(params))
        print(f"\nmlp {options or '(default)'}: {size:,} parameters; ms per update of 12 runs (first call, s)")
        print("| n | asgd | ia2sgd | one_of, fixed | one_of, batched | batched / ia2sgd |")
        print("|---|---|---|---|---|---|")
        for m in (4, 16, 64):
            table = lambda h, m=m: rules.ia2sgd(h["lr"], num_workers=m)
            cases = {
                "asgd": lambda h: rules.asgd(h["lr"]),
                "ia2sgd": table,
                "fixed": lambda h, t=table: rules.one_of(0, [rules.asgd(h["lr"]), t(h)]),
                "batched": lambda h, t=table: rules.one_of(
                    (h["lr"] > 0.15).astype(jnp.int32), [rules.asgd(h["lr"]), t(h)]
                ),
            }
            got = {k: _sweep(loss, rule, params, state, ds.train, m) for k, rule in cases.items()}
            cells = " | ".join(f"{steady:.2f} ({first:.1f} s)" for first, steady in got.values())
            print(f"| {m} | {cells} | {got['batched'][1] / got['ia2sgd'][1]:.2f} |")


if __name__ == "__main__":
    main()
