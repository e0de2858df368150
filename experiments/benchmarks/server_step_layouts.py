"""Could a hand-written DC-ASGD-a server step be laid out so XLA:CPU makes fewer passes over parameter memory?

Three layouts of the same algorithm (8 per-worker backups, workers pushing in turn, DC-ASGD-a with one global
MeanSquare: what ``simulator_overhead.py`` calls hand-written), each in a plain ``lax.scan``, nothing from asgd_jax,
timed against the ``optax.sgd`` floor in the same repeats:

* ``plain``: weights, MeanSquare and a ``[M, ...]`` backup stack; the pull writes the new weights into the pusher's
  slot (``backups.at[m].set(w)``). What the simulator does; ``simulator_overhead.py``'s hand-written engine.
* ``indexed``: the live weights are one more buffer of an ``[M + 2, ...]`` stack with an index, each slot an index into
  it; the update writes the new weights straight into a free buffer and the pull is an integer assignment (no copy of
  the weights into a backup).
* ``stacked``: weights and MeanSquare stacked into one ``[2, ...]`` array, so one loop could write both (XLA:CPU has no
  multi-output fusion). DC-ASGD-a only.
* ``pulled``: a worker's next gradient computed when it pulls, at the live weights, and kept until its push (the same
  arithmetic: a gradient depends only on the weights pulled and the next minibatch); no backup is copied to feed a
  dot. ASGD keeps no backups, DC-ASGD-a keeps them for the correction. Not what the simulator does (see the README).

    .venv/bin/python experiments/benchmarks/server_step_layouts.py               # the 1.1M-parameter MLP (L)
    .venv/bin/python experiments/benchmarks/server_step_layouts.py --width 256   # W
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import simulator_overhead as bench

M = bench.HAND_WORKERS
tree = jax.tree.map


def layouts(wl, length: int):
    """name -> (jitted chunk(carry, key, t0) -> carry over ``length`` updates, its first carry)."""
    params, gradient = wl["params"], bench.minibatch_gradient(wl)

    def plain(kind):
        # simulator_overhead's hand-written engine: what the simulator does.
        chunk = bench.floor_chunk(wl, length, kind=kind)
        return (lambda c, k, t0: chunk(c, k)), bench.floor_carry(wl, kind)

    def indexed(kind):
        def step(c, k, t):
            ms, buffers, live, slot_of = c
            m = t % M
            stale = tree(lambda b: b[slot_of[m]], buffers)
            g = gradient(stale, k)
            # A buffer no slot but the pusher's refers to, and not the live one: where the new weights go.
            refs = jnp.zeros(M + 2, jnp.int32).at[slot_of].add(1).at[slot_of[m]].add(-1).at[live].add(1)
            free = jnp.argmin(refs)
            w, ms = bench.hand_server_step(kind, tree(lambda b: b[live], buffers), g, ms, stale)
            buffers = tree(lambda b, w: b.at[free].set(w), buffers, w)
            return ms, buffers, free, slot_of.at[m].set(free)

        stack = tree(lambda x: jnp.broadcast_to(x, (M + 2, *x.shape)).copy(), params)
        return chunk_of(step, length), (tree(jnp.zeros_like, params), stack, jnp.int32(0), jnp.zeros(M, jnp.int32))

    def stacked():
        def step(c, k, t):
            both, backups = c
            stale = tree(lambda b: b[t % M], backups)
            g = gradient(stale, k)
            both = [
                jnp.stack(bench.hand_server_step("dc_asgd_a", x[0], g, x[1], s))
                for x, g, s in zip(both, g, stale, strict=True)
            ]
            return both, tree(lambda b, x: b.at[t % M].set(x[0]), backups, both)

        stack = tree(lambda x: jnp.broadcast_to(x, (M, *x.shape)).copy(), params)
        return chunk_of(step, length), ([jnp.stack([x, jnp.zeros_like(x)]) for x in params], stack)

    def pulled(kind):
        # A worker's next gradient computed when it pulls, at the live weights (no backup copied for a dot); the push
        # reads it back. ASGD keeps no backups at all, DC-ASGD-a keeps them for its correction only.
        dc = kind == "dc_asgd_a"

        def step(c, k, t):
            params, ms, backups, pending = c
            m = t % M
            g, stale = tree(lambda p: p[m], pending), tree(lambda b: b[m], backups) if dc else params
            params, ms = bench.hand_server_step(kind, params, g, ms, stale)
            pending = tree(lambda p, g: p.at[m].set(g), pending, gradient(params, k))
            backups = tree(lambda b, w: b.at[m].set(w), backups, params) if dc else backups
            return params, ms, backups, pending

        first = jax.vmap(gradient, in_axes=(None, 0))(params, jax.random.split(jax.random.key(9), M))
        stack = tree(lambda x: jnp.broadcast_to(x, (M, *x.shape)).copy(), params) if dc else ()
        return chunk_of(step, length), (tree(jnp.copy, params), tree(jnp.zeros_like, params), stack, first)

    return {
        "plain ASGD": plain("asgd"),
        "pulled ASGD": pulled("asgd"),
        "pulled DC-ASGD-a": pulled("dc_asgd_a"),
        "indexed ASGD": indexed("asgd"),
        "plain DC-ASGD-a": plain("dc_asgd_a"),
        "indexed DC-ASGD-a": indexed("dc_asgd_a"),
        "stacked DC-ASGD-a": stacked(),
    }


def chunk_of(step, length):
    def chunk(carry, key, t0):
        body = lambda c, xs: (step(c, *xs), None)
        ts = t0 + jnp.arange(length, dtype=jnp.int32)
        return jax.lax.scan(body, carry, (jax.random.split(key, length), ts))[0]

    return jax.jit(chunk, donate_argnums=0)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024, help="hidden width of the MLP 64-w-w-10 (1024: L, 256: W)")
    parser.add_argument("--length", type=int, default=100, help="updates per timed chunk")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    wl = bench.mlp_workload((64, args.width, args.width, 10), 64)
    floor = bench.floor_chunk(wl, args.length)
    runs = {"floor": (lambda c, k, t0: floor(c, k), bench.floor_carry(wl))}
    runs.update(layouts(wl, args.length))
    carries = {name: carry for name, (_, carry) in runs.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.repeats + 1):  # the first round compiles
        for name, (fn, _) in runs.items():
            start = time.perf_counter()
            carries[name] = jax.block_until_ready(fn(carries[name], jax.random.key(r), jnp.int32(r * args.length)))
            if r:
                times[name].append(time.perf_counter() - start)
    params = bench.num_params(wl["params"])
    print(
        f"jax {jax.__version__} on {jax.default_backend()}; MLP 64-{args.width}-{args.width}-10 ({params:,} parameters)"
    )
    print(f"  {'layout':20s} {'μs/update':>10s} {'ratio to the floor':>19s}")
    for name, ts in times.items():
        ratio = statistics.median(t / f for t, f in zip(ts, times["floor"], strict=True))
        print(f"  {name:20s} {1e6 * statistics.median(ts) / args.length:10.1f} {ratio:19.2f}")


if __name__ == "__main__":
    main()
