"""What a run of M = 1,000 workers holds in memory, per delay model, and what an update costs there.

For each model size (the parameter count a cost that grows with it would hide in a small model) and each delay model
of 1,000 workers, the simulator's state (weights, backups, the delay model's state, data positions: what a run holds
between updates, and what a checkpoint writes), the compiled chunk's temporaries (XLA's memory analysis) and the
seconds per update of a run, measured side by side in one process:

* ``Workers(1000)`` (ASGD): one backup of the weights per worker, M x params;
* ``Ringmaster(law, R=6)`` (with and without stops): a ring of R weight versions;
* ``Rennala(law, S=8, stops)``, ``MSync(law, m=100)``: every update at w_t, one copy.

The floor is plain SGD over the same minibatches (``Workers(1)``). Ratios are per-update time over the floor's; a
round model's update is the mean of several gradients (its column says how many).

    .venv/bin/python experiments/benchmarks/cluster_memory.py          # ~2 minutes on 2 cores
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import asgd_jax
from asgd_jax import delays

M = 1000
UPDATES = 400


def problem(dim: int):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2 * M, dim)).astype(np.float32)  # two examples per worker's shard
    data = {"x": x, "y": (x @ rng.normal(size=dim)).astype(np.float32)}
    loss = lambda w, b: 0.5 * jnp.mean((b["x"] @ w - b["y"]) ** 2)
    return loss, jnp.zeros(dim, jnp.float32), data


def models():
    law = delays.Workers.with_times(delays.sqrt_times(M), noise=0.1)
    return {
        "Workers(1) (floor: SGD)": delays.Workers(1),
        "Workers(1000) (ASGD)": delays.Workers(M),
        "Ringmaster(R=6)": delays.Ringmaster(law, 6),
        "Ringmaster(R=6, stops)": delays.Ringmaster(law, 6, stops=True),
        "Rennala(S=8, stops)": delays.Rennala(law, 8, stops=True),
        "MSync(m=100)": delays.MSync(law, 100),
    }


def measure(dim: int) -> list[tuple[str, float, float, float]]:
    loss, w0, data = problem(dim)
    rule = asgd_jax.rules.get("sgd", 0.1 / dim)  # below 1 / L (L ~ dim for one example)
    rows = []
    for name, model in models().items():
        plan = asgd_jax.Plan(model, num_updates=UPDATES, batch_size=1, chunk=UPDATES)
        lowered = asgd_jax.simulator.lower(loss, rule, w0, data, plan)
        state = lowered.args_info[0][0]  # the simulator's state: weights, backups, delay model, data positions
        state_bytes = sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))
        mem = lowered.compile().memory_analysis()
        run = lambda plan=plan: asgd_jax.simulate(loss, rule, w0, data, plan, key=jax.random.key(0), progress=False)
        jax.block_until_ready(run().params)  # compiled, then timed
        start = time.perf_counter()
        jax.block_until_ready(run().params)
        per_update = (time.perf_counter() - start) / UPDATES
        payloads = plan.payloads
        rows.append((name, state_bytes / 2**20, mem.temp_size_in_bytes / 2**20, per_update, payloads))
    return rows


def main() -> None:
    print(f"M = {M} workers, {UPDATES} updates, batch 1, least squares; memory from XLA's analysis of the chunk\n")
    for dim in (1_000, 100_000):
        rows = measure(dim)
        floor = rows[0][3]
        print(f"params = {dim:,} ({dim * 4 / 2**20:.2f} MiB of weights)\n")
        print("| delay model | state (MiB) | temporaries (MiB) | gradients per update | ms per update | ÷ floor |")
        print("|---|---|---|---|---|---|")
        for name, state, temp, per, k in rows:
            print(f"| {name} | {state:.2f} | {temp:.1f} | {k} | {1e3 * per:.3f} | {per / floor:.2f} |")
        print()


if __name__ == "__main__":
    main()
