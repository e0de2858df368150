"""A per-worker table costs one row per update, whatever the loss: an elementwise loss beside least squares.

With per-worker backups (``delays.Workers(n)``, ASGD), an update reads the pushing worker's row of the ``[n, d]``
backup stack and writes the puller's. Issue #36 measured an elementwise loss's gradient (``0.5 x·x``, read straight
from the row) at 27.8x least squares' cost per update at n = 1,000, d = 1,729: XLA:CPU copied the whole stack to order
the fused reads before the in-place write. This times both losses on the same cluster, n = 1,000 and 6,174, d = 64 and
1,729, batch 1: microseconds per update in the steady state (a second call, another key: nothing compiles) and the
first call's seconds (compilation included), and the elementwise ÷ least-squares ratio of the same run.

    .venv/bin/python experiments/benchmarks/stack_rows.py            # ~2 minutes on 2 cores
    PYTHONPATH=<other checkout> .venv/bin/python experiments/benchmarks/stack_rows.py   # the same on another commit
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import asgd_jax
from asgd_jax import delays

UPDATES = 2000


def losses() -> dict:
    return {
        "elementwise": lambda w, b: 0.5 * jnp.sum(w * w) + 0.0 * jnp.mean(b["y"]),
        "least squares": lambda w, b: 0.5 * jnp.mean((b["x"] @ w - b["y"]) ** 2),
    }


def timed(loss, n: int, d: int, data) -> tuple[float, float]:
    """(first call's seconds, steady microseconds per update)."""
    plan = asgd_jax.Plan(delays.Workers(n), batch_size=1, num_updates=UPDATES, chunk=500)
    run = lambda seed: asgd_jax.simulate(
        loss, asgd_jax.asgd(1e-3), np.zeros(d, np.float32), data, plan, key=jax.random.key(seed), progress=False
    )
    t0 = time.perf_counter()
    jax.block_until_ready(run(0).params)
    t1 = time.perf_counter()
    jax.block_until_ready(run(1).params)
    return t1 - t0, (time.perf_counter() - t1) / UPDATES * 1e6


def main() -> None:
    print(f"jax {jax.__version__}; ASGD, delays.Workers(n), batch 1, {UPDATES} updates")
    print("| n | d | elementwise us/update (first call s) | least squares us/update (first call s) | ratio |")
    print("|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for n in (1000, 6174):
        for d in (64, 1729):
            x = rng.normal(size=(n, d)).astype(np.float32)
            data = {"x": x, "y": x @ rng.normal(size=d).astype(np.float32)}
            (e_first, e), (l_first, ls) = (timed(f, n, d, data) for f in losses().values())
            print(f"| {n:,} | {d:,} | {e:.1f} ({e_first:.1f}) | {ls:.1f} ({l_first:.1f}) | {e / ls:.2f} |", flush=True)


if __name__ == "__main__":
    main()
