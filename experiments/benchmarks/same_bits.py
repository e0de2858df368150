"""The same bits before and after a change: a dozen configurations' arrays, saved by one checkout and compared.

Fifteen configurations (every delay model, SSGD, n_sync with both local-step push modes, stragglers and speeds,
Gap-Aware, DANA, an MLP with evaluation on mnist1d, two sweeps, and three studies in a tiny form: 1,066 arrays of
weights, per-update metrics and results) run through whichever asgd_jax is importable: the keyword API of before the
run was one value (a0a22b4 and earlier) or the ``Plan`` API. Save with one checkout, save with the other, compare:

    PYTHONPATH=<old checkout> .venv/bin/python experiments/benchmarks/same_bits.py save /tmp/old.npz   # ~3 minutes
    .venv/bin/python experiments/benchmarks/same_bits.py save /tmp/new.npz
    .venv/bin/python experiments/benchmarks/same_bits.py compare /tmp/old.npz /tmp/new.npz
"""

import collections
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

import asgd_jax
from asgd_jax import delays, studies

NEW = hasattr(asgd_jax, "Plan")
rng = np.random.default_rng(0)
X = rng.normal(size=(96, 4)).astype(np.float32)
DATA = {"x": X, "y": (X @ rng.normal(size=4) + 0.1 * rng.normal(size=96)).astype(np.float32)}
W0 = rng.normal(size=4).astype(np.float32)
loss = lambda w, b: 0.5 * jnp.mean((b["x"] @ w - b["y"]) ** 2)
out = {}


def sim(name, rule, model, loss=loss, params=W0, data=DATA, key=0, **kw):
    kw.setdefault("batch_size", 8)
    kw.setdefault("num_updates", 60)
    plan_fields = {"num_updates", "batch_size", "mode", "n_sync", "push", "local_lr", "eval_every"}
    opts = {k: v for k, v in kw.items() if k not in plan_fields}
    if NEW:
        plan = asgd_jax.Plan(model, **{k: v for k, v in kw.items() if k in plan_fields})
        r = asgd_jax.simulate(
            loss, rule, jax.tree.map(jnp.asarray, params), data, plan, key=jax.random.key(key), progress=False, **opts
        )
    else:
        kw2 = {("local_learning_rate" if k == "local_lr" else k): v for k, v in kw.items()}
        r = asgd_jax.simulate(
            loss,
            rule,
            jax.tree.map(jnp.asarray, params),
            data,
            delays=model,
            key=jax.random.key(key),
            progress=False,
            **kw2,
        )
    out[name + "/params"] = np.asarray(jax.tree.leaves(r.params)[0])
    for k, v in r.metrics.items():
        out[f"{name}/m/{k}"] = np.asarray(v)


def swp(name, rule_fn, model, keys, hp, delays_fn=None, **kw):
    kw.setdefault("batch_size", 8)
    kw.setdefault("num_updates", 50)
    if NEW:
        plan = asgd_jax.Plan(model, **kw)
        r = asgd_jax.sweep(
            loss, rule_fn, jnp.asarray(W0), DATA, plan, keys=keys, hparams=hp, delays_fn=delays_fn, progress=False
        )
    else:
        r = asgd_jax.sweep(
            loss, rule_fn, jnp.asarray(W0), DATA, keys=keys, hparams=hp, delays=delays_fn or model, progress=False, **kw
        )
    out[name + "/params"] = np.asarray(r.params)
    for k, v in r.metrics.items():
        out[f"{name}/m/{k}"] = np.asarray(v)


def save(path: str) -> None:
    sim("workers4_dca", asgd_jax.dc_asgd(0.05, 2.0, adaptive=True), delays.Workers(4))
    sim("fixed3_asgd_mom", asgd_jax.asgd(0.05, momentum=0.5), delays.FixedDelay(3))
    sim("random4_dcc", asgd_jax.dc_asgd(0.05, 0.5), delays.RandomDelay(4))
    sim("trace_dca", asgd_jax.dc_asgd(0.05, 2.0, adaptive=True), delays.Trace(rng.integers(0, 3, 60), num=3))
    sim("ssgd3", asgd_jax.asgd(0.05), delays.Workers(3), mode="sync")
    sim("nsync4_acc", asgd_jax.asgd(0.05), delays.Workers(4), n_sync=4, push="accumulate", num_updates=20)
    sim("nsync3_delta", asgd_jax.asgd(1.0), delays.Workers(2), n_sync=3, push="delta", local_lr=0.05, num_updates=20)
    sim(
        "stragglers_gap",
        asgd_jax.rules.gap_aware(0.05),
        delays.Workers(4, straggler_prob=0.3, speeds=[1.0, 0.5, 1.0, 2.0]),
    )
    sim("dana", asgd_jax.rules.dana(0.05, num_workers=4), delays.Workers(4, compute_time="lognormal"))
    ds = asgd_jax.data.load("mnist1d")
    model = asgd_jax.models.get("mlp", num_classes=10, input_shape=ds.input_shape)
    p0, s0 = model.init(jax.random.key(0))
    sim(
        "mnist1d_mlp_eval",
        asgd_jax.dc_asgd(0.1, 2.0, adaptive=True),
        delays.Workers(8),
        loss=asgd_jax.classification_loss(model),
        params=p0,
        data=ds.train,
        model_state=s0,
        num_updates=200,
        batch_size=32,
        eval_fn=asgd_jax.classification_eval(model, ds.test),
        eval_every=50,
    )
    keys, hp = asgd_jax.grid(seeds=[0, 1], lam=[0.0, 2.0])
    swp("sweep_lam", lambda h: asgd_jax.dc_asgd(0.05, h["lam"], adaptive=True), delays.Workers(4), keys, hp)
    keys, hp = asgd_jax.grid(seeds=[0], p=[0.0, 0.5], mean=[1.0, 3.0])
    make = lambda p, mean: delays.Workers(3, straggler_prob=p, mean_compute_time=mean, straggler_slowdown=5.0)
    swp(
        "sweep_delays",
        lambda h: asgd_jax.asgd(0.05),
        make(0.5, 1.0),
        keys,
        hp,
        delays_fn=lambda h: make(h["p"], h["mean"]),
    )

    TINY = studies.Settings(dataset="digits", seeds=(0, 1), epochs=1.0, evals=2, window=10, warm_epochs=0.5)
    for name, settings in [
        ("dcasgd_table1", dataclasses.replace(TINY, workers=(1, 2, 4))),
        ("gpu_asgd_nsync", TINY),
        ("staleness_leaderboard", dataclasses.replace(TINY, workers=(4,), seeds=(0,))),
    ]:
        study = studies.load(name)
        res = studies.run(study, settings=settings, quick=True, progress=False)
        for i, r in enumerate(res.runs):
            for k in ("test_error", "train_error", "time_to_target", "virtual_time", "mean_staleness"):
                out[f"study/{name}/{i}/{k}"] = np.asarray(r[k])
    np.savez(path, **out)
    print(len(out), "arrays")


def compare(old_path: str, new_path: str) -> None:
    a, b = np.load(old_path), np.load(new_path)
    groups = collections.defaultdict(lambda: [0, 0, 0.0, []])
    for k in sorted(set(a.files) | set(b.files)):
        g = k.split("/")[0] if not k.startswith("study/") else "/".join(k.split("/")[:2])
        if k not in a.files or k not in b.files:
            groups[g][3].append(k)
            continue
        x, y = a[k], b[k]
        same = x.shape == y.shape and np.array_equal(x, y, equal_nan=True)
        groups[g][0] += 1
        groups[g][1] += same
        if not same and x.shape == y.shape and np.issubdtype(x.dtype, np.floating) and x.size:
            groups[g][2] = max(groups[g][2], float(np.nanmax(np.abs(x - y) / (np.abs(x) + 1e-12))))
    total = sum(v[0] for v in groups.values()), sum(v[1] for v in groups.values())
    for g, (n, same, rel, missing) in groups.items():
        print(
            f"{g:32s} {same}/{n} identical  max rel diff {rel:.2e}  {'missing: ' + str(missing[:3]) if missing else ''}"
        )
    print(f"{total[1]} of {total[0]} arrays identical")


if __name__ == "__main__":
    if sys.argv[1:2] == ["save"]:
        save(sys.argv[2])
    elif sys.argv[1:2] == ["compare"]:
        compare(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(__doc__)
