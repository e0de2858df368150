"""Waiting pushes applied in one program against as many exchange calls dispatched back to back. Ratios, side by side.

Issue #33 asks four pushing threads to reach 0.9 of 1 / (exchange time); at the `cnn`'s size they reach about half.
Is a push's dispatch the limit? This script applies K = 4 pushes to a copy of a store's state two ways, at the `cnn`
and ResNet-20 sizes, for ASGD and DC-ASGD-a (M = 4, the store on the host CPU):

- back to back: the store's own exchange program (``StoreState.programs.exchange``) called K times without waiting
  between the calls (JAX dispatches each while the one before computes), then the last answer waited for;
- one scan: a program whose ``lax.scan`` runs the same exchange (``exchange_packed``) over the K payloads.

It prints both medians (us), their ratio, and whether the final state and the K answers are the same bits.

    .venv/bin/python experiments/benchmarks/grouped_pushes.py     # ~1 minute on 2 cores
"""

from __future__ import annotations

import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from store_push import median_us  # (this folder's: a script's own folder is on sys.path)

import asgd_jax
from asgd_jax.trainer.store import ParameterStore

K = 4
MODELS = {"cnn": (8, 8, 1), "resnet20": (32, 32, 3)}


def measure(params, rule_name: str, n: int) -> tuple[float, float, bool]:
    """(K calls us, one scan us, same bits) for one model and rule."""
    with tempfile.TemporaryDirectory() as out:
        store = ParameterStore(asgd_jax.rules.get(rule_name, 1e-3), params, 4, out_dir=out)
        server, device = store.server, store.server.device
        programs, numbers = server.programs, server.numbers
        rng = np.random.default_rng(0)
        sizes = list(zip(store.layout.sizes, store.layout.dtypes, strict=True))
        g = tuple(jax.device_put((rng.normal(size=k) * 1e-3).astype(d), device) for k, d in sizes)
        payloads = [g, jax.tree.map(lambda x: -x, g)] * (K // 2)  # (K pushes, from workers 0 to K - 1)
        workers = [jax.device_put(np.int32(w), device) for w in range(K)]
        ok = jax.device_put(np.bool_(True), device)
        stacked = (jnp.stack(workers), jax.tree.map(lambda *x: jnp.stack(x), *payloads))

        def step(st, x):
            st, flags, sent, version = programs.exchange_packed(st, numbers, x[0], x[1], (), ok)
            return st, (flags, sent, version)

        scan = jax.jit(lambda st, ws, gs: jax.lax.scan(step, st, (ws, gs)), donate_argnums=0)
        copy = lambda: jax.device_put(jax.device_get(server.stored), device)

        def back_to_back(st):
            answers = []
            for w, g in zip(workers, payloads, strict=True):
                st, _, sent, _ = programs.exchange(st, numbers, w, g, (), ok)
                answers.append(sent)
            return st, answers

        st, answers = back_to_back(copy())
        grouped, (_, sents, _) = scan(copy(), *stacked)
        same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(st), jax.tree.leaves(grouped), strict=True))
        same = same and all(
            np.array_equal(answers[i][0][j], sents[0][j][i]) for i in range(K) for j in range(len(sizes))
        )
        state = [copy(), copy()]

        def calls() -> None:
            state[0], answers = back_to_back(state[0])
            jax.block_until_ready(answers[-1])

        def one_scan() -> None:
            state[1], out = scan(state[1], *stacked)
            jax.block_until_ready(out)

        calls()
        one_scan()
        result = median_us(calls, n), median_us(one_scan, n), same
        store.close()
    return result


def main() -> None:
    print(f"jax {jax.__version__}, store on {jax.devices('cpu')[0]}, M = 4, K = {K} pushes; medians in us")
    print(
        "| model | rule | K calls back to back | one scan of K | scan ÷ calls | same bits |\n|---|---|---|---|---|---|"
    )
    for name, shape in MODELS.items():
        model = asgd_jax.models.get(name, num_classes=10, input_shape=shape)
        params = model.init(jax.random.key(0))[0]
        for rule_name in ("asgd", "dc_asgd_a"):
            calls, scan, same = measure(params, rule_name, 200 if name == "cnn" else 50)
            print(f"| {name} | {rule_name} | {calls:,.0f} | {scan:,.0f} | {scan / calls:.2f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
