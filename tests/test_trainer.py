"""The parameter store and the threaded multi-device trainer; its recorded trace replays in the simulator."""

from __future__ import annotations

import json
import os
import pathlib
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.compiles import compilations
from helpers.problems import DATA, W0, lsq_loss, replay_clean, simulate_clean, train_config

import asgd_jax
from asgd_jax import exchange, packing
from asgd_jax.loss import as_loss
from asgd_jax.plan import Plan
from asgd_jax.trainer import TrainConfig, train
from asgd_jax.trainer.endpoint import Endpoint
from asgd_jax.trainer.loader import ShardLoader


@pytest.fixture
def no_implicit_transfers():
    """Every host <-> device copy in the trainer must be explicit (device_put / device_get)."""
    jax.config.update("jax_transfer_guard", "disallow")
    try:
        yield
    finally:
        jax.config.update("jax_transfer_guard", "allow")


RULES = {"asgd": lambda: asgd_jax.asgd(0.05), "dc_asgd_a": lambda: asgd_jax.dc_asgd(0.05, 2.0, adaptive=True)}


@pytest.mark.parametrize(
    ("rule_name", "n_sync", "push", "local_lr", "store_device"),
    [
        ("asgd", 1, "gradients", None, "cpu"),
        ("dc_asgd_a", 1, "gradients", None, "cpu"),
        ("asgd", 3, "delta", 0.05, "cpu"),
        ("dc_asgd_a", 2, "accumulate", None, "cpu"),
        ("asgd", 2, "gradients", 0.02, "cpu"),
        ("dc_asgd_a", 1, "gradients", None, "cpu:7"),  # a store on a device of its own: pushes device to device
    ],
)
def test_trainer_trace_replays_in_the_simulator(tmp_path, rule_name, n_sync, push, local_lr, store_device, request):
    """The signature property: the trace of a real multi-device run replays in the simulator to the same weights,
    for every n_sync and push mode, wherever the store keeps its state."""
    key = jax.random.key(5)
    request.getfixturevalue("no_implicit_transfers")
    steps = 40 if n_sync == 1 else 16
    sync = dict(n_sync=n_sync, push=push, local_lr=local_lr)
    result = train(
        lsq_loss,
        RULES[rule_name](),
        W0,
        DATA,
        TrainConfig(
            Plan(4, num_updates=steps, batch_size=4, **sync), seed=5, out=str(tmp_path), store_device=store_device
        ),
        devices=jax.devices()[:4],
    )
    jax.config.update("jax_transfer_guard", "allow")  # the replay below is ordinary host-side code
    assert result.pushes_applied == steps
    assert result.pushes_sent == result.pushes_applied + result.pushes_rejected
    assert result.pushes_rejected == result.pushes_late  # nothing bad was pushed: only pushes in flight at the end
    assert not result.failures
    trace = asgd_jax.delays.Trace.load(result.trace_path, num=4)
    assert len(trace) == steps
    replay = simulate_clean(RULES[rule_name](), trace, steps, key=key, **sync)
    np.testing.assert_allclose(replay.params, result.params, rtol=1e-5, atol=1e-6)
    # The trace's staleness is what the server saw.
    records = [json.loads(line) for line in pathlib.Path(result.trace_path).read_text().splitlines()]
    np.testing.assert_array_equal(replay.metrics["staleness"], [r["staleness"] for r in records])
    assert sum(result.staleness_counts.values()) == steps
    assert sum(w.pushes for w in result.workers) == result.pushes_sent


@pytest.mark.parametrize(
    ("push", "inner", "dylu"),
    [("delta", "sgd", False), ("accumulate", "sgd", False), ("gradients", "sgd", False), ("delta", "adamw", True)],
)
def test_every_way_of_compiling_a_period_computes_the_same(push, inner, dylu):
    # A CPU worker's period is unrolled into one program up to CPU_UNROLL steps and a program per step beyond; an
    # accelerator's is one rolled scan (exchange.period_loop). The same payload, loss and check every way: the same
    # bits, but for an inner optimizer's DyLU period (AdamW's masked steps: XLA rounds the unrolled one differently).
    n_sync, local_lr = 5, None if push == "accumulate" else 0.05
    plan = Plan(2, num_updates=1, batch_size=4, n_sync=n_sync, push=push, local_lr=local_lr, inner=inner)
    ex = exchange.Exchange.create(plan, DATA)
    loss, layouts = as_loss(lsq_loss, has_model_state=False), packing.layouts(W0, None)
    rng = np.random.default_rng(0)
    batches = {k: rng.normal(size=(n_sync, 4, *v.shape[1:])).astype(np.float32) for k, v in DATA.items()}
    put = lambda x: jax.device_put(x, jax.devices("cpu")[0])
    lr = put(np.float32(local_lr or 0.0))
    args = (layouts[0].pack(put(W0 + 0.1)), layouts[1].pack(None), batches, jax.random.key(3), lr, put(np.int32(4)))
    own = (put(exchange.inner_optimizer(inner, 0.0).init(W0)), put(np.int32(3))) if dylu else ()
    ways = [("scan", 1), ("scan", n_sync)] + ([] if dylu else [("steps", 1)])
    outputs = {
        (loop, unroll): jax.device_get(
            exchange.worker_function(loss, ex, 2, layouts, loop=loop, dylu=dylu, unroll=unroll)(
                *args, put(np.int32(1)), *own
            )
        )
        for loop, unroll in ways
    }
    first = outputs[("scan", 1)]
    for way, out in outputs.items():
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(first), strict=True):
            if dylu:
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=str(way))
            else:
                np.testing.assert_array_equal(a, b, err_msg=str(way))
    assert exchange.period_loop("cpu", n_sync) == ("scan", n_sync)
    assert exchange.period_loop("cpu", exchange.CPU_UNROLL + 1) == ("steps", 1)


@pytest.mark.parametrize("loop", ["scan", "steps"])
def test_a_workers_local_learning_rate_is_an_argument_of_its_program(loop):
    # Numbers are arguments: the period at another local learning rate is the same program, compiled once (it was a
    # constant in the program: every --local-lr of a sweep compiled its own), and computes with the rate it is given.
    plan = Plan(2, num_updates=1, batch_size=4, n_sync=3, push="delta", local_lr=0.05)
    ex = exchange.Exchange.create(plan, DATA)
    layouts = packing.layouts(W0, None)
    put = lambda x: jax.device_put(x, jax.devices("cpu")[0])
    batches = {k: np.stack([v[:4]] * 3) for k, v in DATA.items()}
    period = exchange.worker_function(as_loss(lsq_loss, has_model_state=False), ex, 2, layouts, loop=loop, unroll=1)
    args = lambda lr: (layouts[0].pack(put(W0)), (), batches, jax.random.key(3), put(np.float32(lr)), put(np.int32(0)))
    with compilations() as counts:
        first = jax.device_get(period(*args(0.05), put(np.int32(1))))
        compiled = sum(counts.values())
        second = jax.device_get(period(*args(0.1), put(np.int32(1))))
    assert sum(counts.values()) == compiled  # (the first call may find its programs in the persistent cache)
    # The first local step is at w_0 either way: its share of the delta scales with the rate; the payload differs.
    assert not np.array_equal(first[0][0], second[0][0]) and np.isfinite(second[0][0]).all()


def test_a_worker_on_the_stores_device_is_computed_by_the_store_and_trains_the_same(tmp_path, no_implicit_transfers):
    # One worker on cpu:0: with the store there too, the store runs the worker's period and the exchange as one
    # program (messages.Computed; the worker books it all as compute); with the store on cpu:1, two programs and a
    # hand-over. The same run either way: the same trace, weights to float rounding (one program or two may
    # contract a multiply-add differently), the same counts.
    def run(store_device):
        config = TrainConfig(
            Plan(1, num_updates=30, batch_size=4), seed=3, out=str(tmp_path / store_device), store_device=store_device
        )
        result = train(lsq_loss, asgd_jax.asgd(0.05), W0, DATA, config, devices=jax.devices()[:1])
        lines = pathlib.Path(result.trace_path).read_text().splitlines()
        return result, [{k: v for k, v in json.loads(line).items() if k != "time"} for line in lines]

    computed, computed_trace = run("cpu")
    handed, handed_trace = run("cpu:1")
    assert computed_trace == handed_trace and len(computed_trace) == 30
    np.testing.assert_allclose(computed.params, handed.params, rtol=1e-6, atol=1e-7)
    assert (computed.pushes_applied, computed.pushes_sent) == (handed.pushes_applied, handed.pushes_sent) == (30, 31)
    assert computed.workers[0].exchange == 0.0 < computed.workers[0].compute
    assert handed.workers[0].exchange > 0.0
    # The push that found the store closed: computed, its period never ran (no loss); handed over, it had.
    assert (len(computed.workers[0].losses), len(handed.workers[0].losses)) == (30, 31)


@pytest.mark.parametrize("n_sync", [1, 3])
def test_a_second_run_at_other_numbers_compiles_nothing_and_replays(tmp_path, n_sync):
    # Every program of a run is kept for its structure, its numbers (the rule's learning rate and lambda, the local
    # learning rate) arguments: a second run at other numbers compiles nothing, not even a load from the persistent
    # cache (a store compiled its 8 programs again for every run), and its trace replays to its weights bit for bit.
    # Worker 0 shares the store's device (cpu:0): its pushes run in the store's kept computed-push program.

    def run(lr: float, lam: float, local_lr: float, name: str):
        local = {"push": "delta", "local_lr": local_lr} if n_sync > 1 else {}
        config = train_config(2, num_updates=12, batch_size=4, n_sync=n_sync, seed=1, out=str(tmp_path / name), **local)
        with compilations() as counts:
            result = train(lsq_loss, asgd_jax.dc_asgd(lr, lam, adaptive=True), W0, DATA, config)
        return result, sum(counts.values())

    run(0.02, 2.0, 0.03, "first")
    again, compiled = run(0.03, 1.0, 0.05, "again")
    assert compiled == 0
    plan = asgd_jax.trainer.replay_plan(tmp_path / "again")
    assert n_sync == 1 or plan.local_lr == 0.05
    replayed = replay_clean(tmp_path / "again", asgd_jax.dc_asgd(0.03, 1.0, adaptive=True), seed=1)
    np.testing.assert_array_equal(replayed.params, again.params)
    asgd_jax.trainer.clear_cache()
    assert run(0.03, 1.0, 0.05, "fresh")[1] > 0  # (forgotten: compiled, or loaded from the persistent cache, again)


# Thirty leaves of 3 to 15 floats: the store steps an elementwise rule on them packed (one buffer), the simulator leaf
# by leaf; the run must still replay bit for bit. (Leaf by leaf in both, ASGD's replay was 231 elements off here.)
LEAVES = {f"l{i:02d}": (i % 5 + 1) * 3 for i in range(30)}


def _leaves_problem():
    rng = np.random.default_rng(0)
    size = sum(LEAVES.values())
    x = rng.normal(size=(96, size)).astype(np.float32)
    data = {"x": x, "y": (x @ rng.normal(size=size)).astype(np.float32)}
    w0 = {k: (0.01 * np.arange(n)).astype(np.float32) for k, n in LEAVES.items()}

    def loss(w, batch):
        flat = jnp.concatenate([w[k] for k in sorted(LEAVES)])
        return 0.5 * jnp.mean((batch["x"] @ flat - batch["y"]) ** 2)

    return loss, w0, data


@pytest.mark.parametrize(
    "make",
    [lambda: asgd_jax.asgd(0.02), lambda: asgd_jax.dc_asgd(0.02, 2.0, adaptive=True)],
    ids=["asgd", "dc_asgd_a"],
)
def test_a_run_of_thirty_leaves_stepped_packed_replays_bit_for_bit(tmp_path, make):
    loss, w0, data = _leaves_problem()
    config = TrainConfig(Plan(2, num_updates=30, batch_size=4), seed=5, out=str(tmp_path))
    result = train(loss, make(), w0, data, config, devices=jax.devices()[:2])
    plan = asgd_jax.trainer.replay_plan(tmp_path)
    replayed = asgd_jax.simulate(loss, make(), w0, data, plan, key=jax.random.key(5), progress=False)
    assert jax.tree.structure(replayed.params) == jax.tree.structure(result.params)
    for k in LEAVES:
        np.testing.assert_array_equal(replayed.params[k], result.params[k], err_msg=k)


def test_a_second_run_evaluates_its_own_split_in_the_first_runs_program(tmp_path):
    # The evaluation's program is kept per eval_fn, and classification_eval's are equal whatever their data (the data
    # is no part of what shapes the program): the held-out split must then be an argument, not the first run's
    # constant (a review found the second run reporting the first one's split).
    ds = asgd_jax.data.load("digits")
    model = asgd_jax.models.get("mlp", num_classes=10, input_shape=ds.input_shape)
    params, state = model.init(jax.random.key(0))
    half = len(ds.test["y"]) // 2
    first = {k: v[:half] for k, v in ds.test.items()}
    second = {"x": ds.test["x"][half : 2 * half], "y": (ds.test["y"][half : 2 * half] + 1) % 10}  # other labels
    assert asgd_jax.classification_eval(model, first) == asgd_jax.classification_eval(model, second)
    loss = asgd_jax.classification_loss(model)

    def run(split, name: str):
        evaluate = asgd_jax.classification_eval(model, split)
        config = TrainConfig(Plan(1, num_updates=4, batch_size=16, eval_every=4), out=str(tmp_path / name))
        result = train(loss, asgd_jax.asgd(0.1), params, ds.train, config, model_state=state, eval_fn=evaluate)
        expected = jax.device_get(evaluate(result.params, result.model_state))  # eager, on the split itself
        return {k: result.evals[-1][k] for k in expected}, {k: float(v) for k, v in expected.items()}

    for split, name in ((first, "first"), (second, "second")):
        got, expected = run(split, name)
        assert got == pytest.approx(expected, rel=1e-6), name


@pytest.mark.parametrize("store_device", ["cpu", "cpu:1"])
def test_workers_that_share_a_device_share_its_compilation(tmp_path, store_device):
    # Four workers on cpu:0: one exchange-period program for all of them, compiled before the run's clock (each
    # compiled its own on its first push, on the clock: 8 workers on one GPU ran at 0.15x a plain loop); with the
    # store there too, one program of their computed pushes.
    config = TrainConfig(Plan(4, num_updates=24, batch_size=4), seed=3, out=str(tmp_path), store_device=store_device)
    asgd_jax.trainer.clear_cache()  # (an earlier test's run of the same structure left its programs)
    with compilations() as counts:
        result = train(lsq_loss, asgd_jax.asgd(0.05), W0, DATA, config, devices=jax.devices()[:1])
    assert result.pushes_applied == 24 and {w.pushes > 0 for w in result.workers} == {True}
    programs = {"cpu": {"computed": 1}, "cpu:1": {"run": 1}}[store_device]
    assert {name: counts[name] for name in programs} == programs


@pytest.mark.parametrize("policy", ["continue", "stop"])
def test_a_failing_worker_is_reported_and_never_deadlocks(monkeypatch, policy):
    # Worker 1's data fails at its first read. The others take their first 3 minibatches (3 + 3 updates: the budget is
    # 30) and then nothing until that failure is known (continue) or has ended the run (stop): the outcome does not
    # depend on which thread runs first.
    original_gather, original_next, original_end = ShardLoader.gather, ShardLoader.__next__, Endpoint.end
    failed, ended = threading.Event(), threading.Event()

    def gather(self, j, n):
        if self.worker == 1:
            raise OSError("disk went away")
        return original_gather(self, j, n)

    def take(self):
        if self.worker != 1:
            if self.taken >= 3:
                (failed if policy == "continue" else ended).wait(60)
            return original_next(self)
        try:
            return original_next(self)
        except RuntimeError:
            failed.set()
            raise

    def end(self, why):
        original_end(self, why)
        ended.set()

    monkeypatch.setattr(ShardLoader, "gather", gather)
    monkeypatch.setattr(ShardLoader, "__next__", take)
    monkeypatch.setattr(Endpoint, "end", end)
    result = train(
        lsq_loss,
        asgd_jax.asgd(0.05),
        W0,
        DATA,
        TrainConfig(Plan(3, num_updates=30, batch_size=4), seed=0, on_worker_failure=policy, timeout=60),
        devices=jax.devices()[:3],
    )
    assert result.failures == {1: "RuntimeError: loader of worker 1 failed: disk went away"}
    assert result.pushes_sent == result.pushes_applied + result.pushes_rejected
    if policy == "continue":
        assert result.pushes_applied == 30  # the other two workers finish the budget
    else:
        assert result.pushes_applied < 30
    assert result.seconds < 60


def dropout_loss(w, model_state, batch, key):
    """Least squares through a dropout layer (rate 0.5, inverted scaling): the model's randomness is the key's."""
    keep = jax.random.bernoulli(key, 0.5, w.shape)
    return 0.5 * jnp.mean((batch["x"] @ jnp.where(keep, 2.0 * w, 0.0) - batch["y"]) ** 2), model_state


@pytest.mark.parametrize("n_sync", [1, 2])
def test_a_dropout_model_replays_exactly_too(tmp_path, n_sync):
    # Workers key their dropout with what they know (the version they pulled, their id), and so does the simulator:
    # the same masks in the replay, not merely similar ones.
    seed, rule = 2, lambda: asgd_jax.dc_asgd(0.05, 2.0, adaptive=True)
    key = jax.random.key(seed)
    sync = dict(n_sync=n_sync, push="accumulate" if n_sync > 1 else "gradients")
    result = train(
        dropout_loss,
        rule(),
        W0,
        DATA,
        train_config(3, num_updates=30, batch_size=4, seed=seed, out=str(tmp_path), **sync),
        model_state={},
        devices=jax.devices()[:3],
    )
    trace = asgd_jax.delays.Trace.load(result.trace_path, num=3)
    replay = simulate_clean(rule(), trace, 30, key=key, loss=dropout_loss, model_state={}, **sync)
    np.testing.assert_allclose(replay.params, result.params, rtol=1e-5, atol=1e-6)


def test_bad_trainer_arguments_raise_before_anything_starts():
    with pytest.raises(ValueError, match="on_worker_failure='retry'"):
        train(lsq_loss, asgd_jax.asgd(0.1), W0, DATA, TrainConfig(Plan(2, num_updates=5), on_worker_failure="retry"))
    with pytest.raises(ValueError, match="batch_size=64"):
        train(lsq_loss, asgd_jax.asgd(0.1), W0, DATA, TrainConfig(Plan(2, num_updates=5, batch_size=64)))
    with pytest.raises(ValueError, match="num_updates=0"):
        train(lsq_loss, asgd_jax.asgd(0.1), W0, DATA, TrainConfig(Plan(2, num_updates=0)))
    bad = {
        "mode='ring'": dict(mode="ring"),
        "devices_per_worker=16 but only 8": dict(devices_per_worker=16),
        "batch_size=6 .* a multiple of devices_per_worker=4": dict(devices_per_worker=4, batch_size=6),
        "warm_start_steps=5 .* fewer than num_updates=5": dict(warm_start_steps=5),
        "checkpoint_every=2 .* need an output folder": dict(checkpoint_every=2),
        "eval_every was given without eval_fn": dict(eval_every=2),
        "slowdown=": dict(slowdown={2: 4.0}),
    }
    for message, kwargs in bad.items():
        with pytest.raises(ValueError, match=message):
            train(lsq_loss, asgd_jax.asgd(0.1), W0, DATA, train_config(2, **{"num_updates": 5, **kwargs}))


def test_cli_train_config_file_resume_and_warm_start(tmp_path, capsys):
    from asgd_jax.cli import main

    config = tmp_path / "run.toml"
    config.write_text(
        'dataset = "digits"\nmodel = "mlp"\nrule = "dc_asgd_a"\nlr = 0.1\nschedule = "constant"\nworkers = 3\n'
        "batch-size = 8\n"
        "steps = 100\neval_every = 10\nno_progress = true\n"
    )
    out = tmp_path / "run"
    assert main(["train", "--config", str(config), "--steps", "30", "--out", str(out)]) == 0  # the flag wins
    assert "applied 30" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["pushes_applied"] == 30 and 0.0 <= summary["test_error"] <= 1.0
    assert summary["args"]["workers"] == 3 and summary["args"]["batch_size"] == 8  # from the file
    assert summary["environment"] == asgd_jax.provenance.environment()  # what produced the run
    assert [e["update"] for e in summary["evals"]] == [10, 20, 30]
    assert len((out / "trace.jsonl").read_text().splitlines()) == 30
    # --resume extends the same run to 40 updates; the trace continues where the checkpoint was.
    assert main(["train", "--config", str(config), "--steps", "40", "--out", str(out), "--resume"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from"] == 30 and summary["pushes_applied"] == 40
    assert len((out / "trace.jsonl").read_text().splitlines()) == 40
    # --warm-start starts from the saved model: its first evaluation is already as good as the run's last.
    warm = tmp_path / "warm"
    argv = ["train", "--config", str(config), "--steps", "1", "--eval-every", "1", "--workers", "1"]
    assert main([*argv, "--warm-start", str(out), "--lr", "0", "--out", str(warm)]) == 0
    assert json.loads((warm / "summary.json").read_text())["test_error"] == summary["test_error"]
    # Bad input: a clear message and exit status 2, before anything runs.
    config.write_text("wokers = 3\n")
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "x")]) == 2
    assert "unknown option(s) wokers" in capsys.readouterr().err
    assert main(["train", "--slowdown", "fast", "--out", str(tmp_path / "y")]) == 2


@pytest.mark.parametrize("lr", [0.0, 0.1])
def test_cli_train_says_when_the_model_learned_nothing(tmp_path, capsys, lr):
    # A classifier that ends no better than guessing (an untouched cnn here; in practice a network that stalled or
    # collapsed to one class under stale updates: 4 workers at --lr 0.5 ended at 92.2% on digits, no NaN to stop it)
    # gets a word on stderr; the run still succeeded. One that learned gets none.
    from asgd_jax.cli import main
    from asgd_jax.cli.train import at_chance

    out = tmp_path / "run"
    argv = ["train", "--dataset", "digits", "--model", "cnn", "--workers", "1", "--steps", "200", "--no-progress"]
    assert main([*argv, "--out", str(out), "--lr", str(lr)]) == 0
    err = capsys.readouterr().err
    error, warned = json.loads((out / "summary.json").read_text())["test_error"], "has not learned" in err
    assert warned == at_chance(error, asgd_jax.data.load("digits").num_classes) == (lr == 0.0)
    assert ("The learning rate is 0: nothing moved." in err) == (lr == 0.0)  # (and no word of workers: there is one)
    assert "--workers" not in err


def test_non_finite_pushes_are_rejected_and_training_goes_on():
    poisoned = {"x": DATA["x"].copy(), "y": DATA["y"]}
    poisoned["x"][7] = np.nan  # every batch holding example 7 yields a NaN gradient
    result = train(
        lsq_loss,
        asgd_jax.asgd(0.05),
        W0,
        poisoned,
        TrainConfig(Plan(2, num_updates=40, batch_size=8), seed=1),
        devices=jax.devices()[:2],
    )
    assert result.pushes_applied == 40 and result.pushes_rejected - result.pushes_late >= 1  # the NaN pushes
    assert result.pushes_sent == result.pushes_applied + result.pushes_rejected
    assert np.isfinite(result.params).all() and not result.failures


def test_the_cli_keeps_a_ray_driver_on_the_cpu_only_before_jax_has_started():
    import subprocess
    import sys

    code = (
        "import jax; from asgd_jax.cli import _keep_the_driver_on_the_cpu as keep; {before}keep(); "
        "print(jax.config.jax_platforms)"
    )
    run = lambda before: subprocess.run(
        [sys.executable, "-c", code.format(before=before)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": ""},
    )
    assert run("").stdout.split() == ["cpu"]  # a fresh driver: its JAX is kept off the GPUs the workers own
    assert run("jax.devices(); ").stdout.split() != ["cpu"]  # too late once JAX started: left as it was
