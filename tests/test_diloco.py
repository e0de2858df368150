"""The DiLoCo family over pushed deltas (Douillard et al. 2023; Liu et al. 2024): synchronous DiLoCo in rounds and
asynchronous DiLoCo on every arrival, each against a float64 NumPy reference of workers taking H local SGD steps
from the weights they pulled (the same minibatches, sharing no code with asgd_jax)."""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import pytest
from helpers.problems import PUSH_ORDER, W1, BatchOrder, crash_at, simulate_lsq
from helpers.reference import lsq_grad
from hypothesis import given, settings
from hypothesis import strategies as st

from asgd_jax import delays, rules

H, LOCAL_LR = 4, 0.05


class OuterNesterov:
    """The outer step on a delta: m <- beta m + delta, w <- w - lr (beta m + delta) (heavy ball without Nesterov)."""

    def __init__(self, lr, beta, nesterov=True):
        self.w, self.m = np.array(W1, np.float64), np.zeros(len(W1))
        self.lr, self.beta, self.nesterov = lr, beta, nesterov

    def apply(self, delta):
        self.m = self.beta * self.m + delta
        self.w = self.w - self.lr * (self.beta * self.m + delta if self.nesterov else self.m)


def _local(w, worker, batches, opt=None, steps=H):
    """``steps`` local steps from ``w`` on the worker's next minibatches, plain SGD or the worker's own optimizer
    ``opt`` (its state lasting across the worker's periods): its weights after them."""
    for _ in range(steps):
        a, y = batches.next(worker)
        g = lsq_grad(w, a, y)
        w = w - LOCAL_LR * g if opt is None else opt.step(w, g)
    return w


@pytest.mark.parametrize(("lr", "beta"), [(1.0, 0.0), (0.7, 0.9)])
def test_synchronous_diloco_steps_on_the_rounds_mean_delta(lr, beta):
    # With outer lr 1 and no momentum the round's step is local SGD's average of the workers' weights.
    num, rounds = 3, 6
    ref, batches = OuterNesterov(lr, beta), BatchOrder(0, num_shards=num)
    for _ in range(rounds):
        deltas = [ref.w - _local(ref.w, m, batches) for m in range(num)]
        ref.apply(np.mean(deltas, axis=0))
    result = simulate_lsq(
        rules.diloco(lr, momentum=beta),
        delays.Workers(num),
        num_updates=rounds,
        mode="sync",
        push="delta",
        n_sync=H,
        local_lr=LOCAL_LR,
    )
    np.testing.assert_allclose(result.params, ref.w, rtol=1e-4, atol=1e-5)


def test_asynchronous_diloco_applies_each_delta_on_arrival():
    num, order = 3, PUSH_ORDER[:30]
    ref, batches = OuterNesterov(0.3, 0.9), BatchOrder(0, num_shards=num)
    sent = {m: ref.w.copy() for m in range(num)}
    for worker in map(int, order):
        ref.apply(sent[worker] - _local(sent[worker], worker, batches))  # the delta, however stale
        sent[worker] = ref.w.copy()
    result = simulate_lsq(
        rules.diloco(0.3), delays.Trace(order, num=num), num_updates=len(order), push="delta", n_sync=H,
        local_lr=LOCAL_LR,
    )  # fmt: skip
    np.testing.assert_allclose(result.params, ref.w, rtol=1e-4, atol=1e-5)


def test_the_async_local_sgd_study_runs_the_family_at_equal_data_and_shows_perplexity():
    import dataclasses
    import math

    from asgd_jax import studies

    study = studies.load("async_local_sgd")
    arms = study.arms(study.full, False)
    assert {a.coords["M"] for a in arms} == {4, 8, 16} and {a.coords["speeds"] for a in arms} == {
        "uniform",
        "heterogeneous",
    }
    for arm in arms:  # every worker pushes a delta after H local steps
        assert (arm.plan.push, arm.plan.n_sync) == ("delta", 8)
        labels = {v.label for v in arm.variants}
        assert (arm.plan.mode == "sync") == (labels == {"DiLoCo (synchronous)"})
        if labels & {"Delayed Nesterov (N = 2M)", "Delayed Nesterov (N = 2M) + DyLU"}:
            assert arm.rule_options["buffer_size"] == 2 * arm.coords["M"]
        assert arm.plan.delays.dylu == (labels == {"Delayed Nesterov (N = 2M) + DyLU"})
    # One cell, a tiny transformer, a few pushes: every series has a perplexity; a diverged one shows as "—".
    tiny = dataclasses.replace(
        study.quick, model_options={"width": 16, "depth": 1, "heads": 2}, seeds=(0,), epochs=0.5, workers=(4,)
    )
    cell = dataclasses.replace(study, arms=lambda s, quick: study.arms(s, quick)[1:2])  # async DiLoCo, two rates
    result = studies.run(cell, settings=tiny, progress=False)
    runs = {r["label"]: r for r in result.runs}
    assert set(runs) == {"async DiLoCo", "async DiLoCo (lr / 10)"}
    start = 28.0  # (about the vocabulary's size: a perplexity below it learnt something)
    assert 1.0 < runs["async DiLoCo (lr / 10)"]["test_perplexity"] < start
    table = studies.format_table(cell, result.runs, 1)
    assert "final test perplexity per token" in table
    diverged = [label for label, r in runs.items() if not math.isfinite(r["test_perplexity"])]
    assert ("—: the run diverged" in table) == bool(diverged)


class AdamW:
    """optax.adamw's defaults in float64: bias-corrected moments, decoupled weight decay 1e-4."""

    def __init__(self, lr, b1=0.9, b2=0.999, eps=1e-8, wd=1e-4):
        self.m, self.v, self.t = np.zeros(len(W1)), np.zeros(len(W1)), 0
        self.lr, self.b1, self.b2, self.eps, self.wd = lr, b1, b2, eps, wd

    def step(self, w, g):
        self.t += 1
        self.m = self.b1 * self.m + (1 - self.b1) * g
        self.v = self.b2 * self.v + (1 - self.b2) * g * g
        m_hat, v_hat = self.m / (1 - self.b1**self.t), self.v / (1 - self.b2**self.t)
        return w - self.lr * (m_hat / (np.sqrt(v_hat) + self.eps) + self.wd * w)


class NesterovSGD:
    """optax.sgd(lr, momentum=0.9, nesterov=True) in float64."""

    def __init__(self, lr, beta=0.9):
        self.trace, self.lr, self.beta = np.zeros(len(W1)), lr, beta

    def step(self, w, g):
        self.trace = g + self.beta * self.trace
        return w - self.lr * (g + self.beta * self.trace)


def test_synchronous_diloco_with_adamw_inner_steps_keeps_each_workers_state_across_rounds():
    num, rounds, inner_lr = 3, 5, 0.02
    ref, batches = OuterNesterov(0.7, 0.9), BatchOrder(0, num_shards=num)
    inner = [AdamW(inner_lr) for _ in range(num)]
    for _ in range(rounds):
        ref.apply(np.mean([ref.w - _local(ref.w, m, batches, inner[m]) for m in range(num)], axis=0))
    result = simulate_lsq(
        rules.diloco(0.7),
        delays.Workers(num),
        num_updates=rounds,
        mode="sync",
        push="delta",
        n_sync=H,
        local_lr=inner_lr,
        inner="adamw",
    )
    np.testing.assert_allclose(result.params, ref.w, rtol=1e-4, atol=1e-5)
    count = result.state.workers[0].count  # every worker's AdamW took H steps a round
    np.testing.assert_array_equal(count, [H * rounds] * num)


def test_asynchronous_diloco_with_momentum_inner_steps_over_a_recorded_order():
    num, order, inner_lr = 3, PUSH_ORDER[:24], 0.02
    ref, batches = OuterNesterov(0.3, 0.9), BatchOrder(0, num_shards=num)
    inner = [NesterovSGD(inner_lr) for _ in range(num)]
    sent = {m: ref.w.copy() for m in range(num)}
    for worker in map(int, order):
        ref.apply(sent[worker] - _local(sent[worker], worker, batches, inner[worker]))
        sent[worker] = ref.w.copy()
    result = simulate_lsq(
        rules.diloco(0.3), delays.Trace(order, num=num), num_updates=len(order), push="delta", n_sync=H,
        local_lr=inner_lr, inner="momentum",
    )  # fmt: skip
    np.testing.assert_allclose(result.params, ref.w, rtol=1e-4, atol=1e-5)


def test_an_inner_optimizer_compiles_once_for_every_local_lr_and_resumes_from_its_checkpoint_bit_for_bit(tmp_path):
    from helpers.compiles import compilations

    common = dict(num_updates=24, push="delta", n_sync=H, inner="adamw", chunk=6)
    run = lambda lr, **kw: simulate_lsq(rules.diloco(0.5), delays.Workers(3), local_lr=lr, **common, **kw)
    full = run(0.02)
    with compilations() as counts:
        other = run(0.01)
    assert sum(counts.values()) == 0 and not np.array_equal(other.params, full.params)  # a number, not a constant

    with pytest.raises(KeyboardInterrupt):
        run(0.02, checkpoint_dir=tmp_path, callback=crash_at(12))
    resumed = run(0.02, checkpoint_dir=tmp_path)
    np.testing.assert_array_equal(resumed.params, full.params)  # the workers' AdamW states came back with it
    jax.tree.map(np.testing.assert_array_equal, resumed.state.workers, full.state.workers)


def test_an_inner_optimizer_is_refused_where_there_are_no_local_steps():
    from asgd_jax.errors import ConfigError
    from asgd_jax.plan import Plan
    from asgd_jax.trainer import TrainConfig

    with pytest.raises(ConfigError, match=r"inner='adamw' \(--inner\) is the optimizer of a worker's local steps"):
        Plan(4, inner="adamw")
    with pytest.raises(ConfigError, match=r"inner='lion' \(--inner\) is invalid: .*'sgd', 'momentum', 'adamw'"):
        Plan(4, push="delta", local_lr=0.1, inner="lion")
    inner = Plan(4, push="delta", local_lr=0.1, inner="adamw")
    for backend in ("threads", "ray"):  # (on either, the store's checkpoints hold the workers' states)
        assert TrainConfig(inner, backend=backend, resume="auto", out="x").resume
    assert (
        "inner" not in Plan(4).describe()
        and Plan(4, push="delta", local_lr=0.1, inner="adamw").describe()["inner"] == "adamw"
    )


@settings(max_examples=60, deadline=None)
@given(
    speeds=st.lists(st.floats(0.01, 100.0), min_size=1, max_size=8),
    n_sync=st.integers(1, 64),
)
def test_dylu_gives_each_worker_its_share_of_the_local_steps(speeds, n_sync):
    law = delays.Workers(len(speeds), speeds=speeds, dylu=True)
    steps = np.asarray(law.local_steps(n_sync))
    assert steps.min() >= 1 and steps.max() == n_sync  # the fastest worker runs all of them
    order = np.argsort(speeds, kind="stable")
    assert np.all(np.diff(steps[order]) >= 0)  # a faster worker never runs fewer
    expected = np.maximum(1, np.floor(np.float32(speeds) / np.float32(max(speeds)) * n_sync))
    assert np.all(np.abs(steps - expected) <= 1)  # floor(v / max v * H), up to float32 rounding at an integer
    plain = delays.Workers(len(speeds), speeds=speeds)
    np.testing.assert_array_equal(plain.local_steps(n_sync), [n_sync] * len(speeds))


def test_dylu_makes_a_half_speed_worker_push_as_often_and_take_half_the_local_steps():
    # Constant times, worker 1 at half speed, H = 4: worker 1 runs 2 steps a period, so both push every 4 time units
    # (ties to the lower id): the order 0, 1, 0, 1, ... and the shards' minibatches taken 4 and 2 a push.
    law = delays.Workers(2, compute_time="constant", speeds=[1.0, 0.5], dylu=True)
    num_updates = 10
    ref, batches = OuterNesterov(0.5, 0.9), BatchOrder(0, num_shards=2)
    sent = {m: ref.w.copy() for m in range(2)}
    for worker in [0, 1] * (num_updates // 2):
        ref.apply(sent[worker] - _local(sent[worker], worker, batches, steps=H if worker == 0 else H // 2))
        sent[worker] = ref.w.copy()
    result = simulate_lsq(rules.diloco(0.5), law, num_updates=num_updates, push="delta", n_sync=H, local_lr=LOCAL_LR)
    np.testing.assert_array_equal(result.metrics["worker"], [0, 1] * (num_updates // 2))
    np.testing.assert_allclose(result.metrics["time"], np.repeat(H * np.arange(1, 6), 2))
    np.testing.assert_array_equal(result.state.data.taken, [H * 5, H // 2 * 5])
    np.testing.assert_allclose(result.params, ref.w, rtol=1e-4, atol=1e-5)
    # With equal speeds DyLU changes nothing.
    same = lambda dylu: simulate_lsq(
        rules.diloco(0.5), delays.Workers(3, dylu=dylu), num_updates=12, push="delta", n_sync=H, local_lr=LOCAL_LR
    )
    np.testing.assert_allclose(same(True).params, same(False).params, rtol=1e-6, atol=1e-7)


def test_dylu_is_refused_outside_asynchronous_local_sgd():
    from asgd_jax.errors import ConfigError
    from asgd_jax.plan import Plan
    from asgd_jax.trainer import TrainConfig

    law = delays.Workers(4, speeds=[1.0, 0.5, 0.5, 0.25], dylu=True)
    for bad in (
        dict(mode="sync", push="delta", n_sync=4),
        dict(push="delta", n_sync=1),
        dict(n_sync=4, push="accumulate"),
    ):
        with pytest.raises(ConfigError, match=r"Workers\(dylu=True\) \(or a DyLU run's Trace\) gives each worker"):
            Plan(law, local_lr=0.1, **bad)
    assert TrainConfig(Plan(law, push="delta", n_sync=4, local_lr=0.1)).plan.delays.dylu  # (the trainer runs it)
    with pytest.raises(ConfigError, match=r"steps=\[4, 0\] is invalid: .* 2 ints >= 1"):
        delays.Trace([0, 1], steps=[4, 0])
    with pytest.raises(ConfigError, match=r"the trace's steps=\[8, 2\] exceed n_sync=4"):
        Plan(delays.Trace([0, 1], steps=[8, 2]), push="delta", n_sync=4, local_lr=0.1)
    with pytest.raises(ConfigError, match=r"Ringmaster over Workers\(dylu=True\)"):
        Plan(delays.Ringmaster(law, 2), push="delta", n_sync=4, local_lr=0.1)
    with pytest.raises(ConfigError, match="dylu"):
        delays.Workers(2, dylu="yes")


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_trainer_run_with_adamw_inner_steps_replays_in_the_simulator(tmp_path, mode):
    # Each worker thread keeps its AdamW state across its applied pushes, as the simulator keeps its row.
    from helpers.problems import DATA, W0, lsq_loss, simulate_clean

    from asgd_jax.plan import Plan
    from asgd_jax.trainer import TrainConfig, train

    sync = dict(n_sync=3, push="delta", local_lr=0.02, inner="adamw", mode=mode)
    steps = 18 if mode == "async" else 6
    config = TrainConfig(Plan(3, num_updates=steps, batch_size=4, **sync), seed=5, out=str(tmp_path), progress=False)
    jax.config.update("jax_transfer_guard", "disallow")  # every host <-> device copy explicit, the state's too
    try:
        result = train(lsq_loss, rules.diloco(0.5), W0, DATA, config, devices=jax.devices()[:3])
    finally:
        jax.config.update("jax_transfer_guard", "allow")
    trace = delays.Trace.load(result.trace_path, num=3) if mode == "async" else delays.Workers(3)
    replay = simulate_clean(rules.diloco(0.5), trace, steps, key=5, **sync)
    np.testing.assert_allclose(replay.params, result.params, rtol=1e-5, atol=1e-6)
    assert result.pushes_applied == steps
    if mode == "async":  # the run's own replay plan says its inner optimizer (and replays to the same weights)
        from asgd_jax.trainer import replay_plan

        plan = replay_plan(tmp_path)
        assert (plan.inner, plan.local_lr, plan.push) == ("adamw", 0.02, "delta")
        again = simulate_clean(rules.diloco(0.5), plan.delays, steps, key=5, **sync)
        np.testing.assert_array_equal(again.params, replay.params)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_resumed_trainer_run_with_adamw_inner_steps_gets_each_workers_state_back_and_replays(
    tmp_path, mode, monkeypatch
):
    # The store keeps each worker's AdamW state as of its last applied push and checkpoints it; a resumed worker goes
    # on from it. The trace of the whole run then replays in the simulator (whose workers never lost theirs).
    from helpers.problems import DATA, W0, lsq_loss, simulate_clean

    from asgd_jax.plan import Plan
    from asgd_jax.trainer import TrainConfig, train

    sync = dict(n_sync=3, push="delta", local_lr=0.02, inner="adamw", mode=mode)
    first, steps = (9, 18) if mode == "async" else (3, 6)
    config = lambda n, **kw: TrainConfig(
        Plan(3, num_updates=n, batch_size=4, **sync), seed=5, out=str(tmp_path), progress=False, **kw
    )
    run = lambda n, **kw: train(lsq_loss, rules.diloco(0.5), W0, DATA, config(n, **kw), devices=jax.devices()[:3])
    if mode == "async":  # no worker starts its second period before each has pushed once: all three in the first 9
        _in_lockstep(monkeypatch, 3, period=3, pushes=first)
    run(first)
    monkeypatch.undo()
    with np.load(tmp_path / "checkpoint.npz") as f:
        kept = [k.split("_")[2:] for k in f.files if k.startswith("array_inner_")]  # (worker, leaf)
    assert {w for w, _ in kept} == {"0", "1", "2"} and len(kept) == 3 * len({i for _, i in kept}) > 3
    result = run(steps, resume=True)
    assert result.resumed_from == first and result.pushes_applied == steps
    trace = delays.Trace.load(result.trace_path, num=3) if mode == "async" else delays.Workers(3)
    replay = simulate_clean(rules.diloco(0.5), trace, steps, key=5, **sync)
    np.testing.assert_allclose(replay.params, result.params, rtol=1e-5, atol=1e-6)


def test_a_perplexity_that_blew_up_but_stayed_finite_shows_in_scientific_form():
    from asgd_jax import studies

    study = studies.load("async_local_sgd")
    run = lambda label, seed, ppl: {
        "label": label, "M": 4, "speeds": "uniform", "seed": seed, "lr": 0.7, "test_perplexity": ppl,
        "test_error": 0.5, "train_error": 0.5,
    }  # fmt: skip
    runs = [run("A", 0, 2.0), run("A", 1, 2.5), run("B", 0, 5.6e21), run("B", 1, 4.4e21), run("C", 0, float("inf"))]
    table = studies.format_table(study, runs, 2)
    assert "| A | 2.25 ± 0.35 |" in table and "| B | 5.0e+21 ± 8.5e+20 |" in table and "| C | — |" in table


@pytest.mark.parametrize("inner", ["sgd", "adamw"])
def test_a_dylu_trainer_run_gives_each_worker_its_share_of_steps_and_replays_from_its_record(tmp_path, inner):
    # Worker w of Workers(speeds, dylu=True) takes floor(v_w / max v * H) of the H local steps; the run's plan.json
    # records those counts and its replay plan replays them, to the trainer's weights.
    from helpers.problems import DATA, W0, lsq_loss, simulate_clean

    from asgd_jax.plan import Plan
    from asgd_jax.trainer import TrainConfig, replay_plan, train

    law = delays.Workers(3, speeds=(1.0, 0.5, 0.25), dylu=True)
    sync = dict(n_sync=4, push="delta", local_lr=0.05, inner=inner)
    config = TrainConfig(Plan(law, num_updates=18, batch_size=4, **sync), seed=5, out=str(tmp_path), progress=False)
    result = train(lsq_loss, rules.diloco(0.5, momentum=0.0), W0, DATA, config, devices=jax.devices()[:3])
    plan = replay_plan(tmp_path)
    assert plan.delays.steps.tolist() == [4, 2, 1]
    replay = simulate_clean(rules.diloco(0.5, momentum=0.0), plan.delays, 18, key=5, **sync)
    np.testing.assert_allclose(replay.params, result.params, rtol=1e-5, atol=1e-6)
    every_step = simulate_clean(
        rules.diloco(0.5, momentum=0.0), delays.Trace.load(result.trace_path, 3), 18, key=5, **sync
    )
    assert not np.allclose(every_step.params, result.params, rtol=1e-5, atol=1e-6)  # (the steps matter)


def test_train_dylu_flag_gives_the_workers_their_steps_and_names_a_bad_value(tmp_path, capsys):
    from asgd_jax.cli import main
    from asgd_jax.trainer import replay_plan

    flags = ["train", "--workers", "2", "--n-sync", "4", "--push", "delta", "--local-lr", "0.05", "--no-progress"]
    assert main([*flags, "--dylu", "1,0.5", "--steps", "6", "--out", str(tmp_path / "run")]) == 0
    assert replay_plan(tmp_path / "run").delays.steps.tolist() == [4, 2]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:  # (argparse's own exit, the value named)
        main([*flags, "--dylu", "1,fast"])
    assert exit_info.value.code == 2 and "'1,fast' is not speeds" in capsys.readouterr().err
    assert main([*flags, "--dylu", "1,0.5", "--msync", "1"]) == 2
    assert "choose one of --ringmaster, --rennala, --msync, --dylu" in capsys.readouterr().err
    assert main([*flags, "--dylu", "1,0.5,0.25"]) == 2
    assert "dylu='1,0.5,0.25' (--dylu) is invalid: give 2 speeds, one per worker" in capsys.readouterr().err


def test_a_dylu_trace_moves_a_shard_by_its_workers_own_steps_past_a_rejected_push_too():
    # A replayed DyLU run: worker 0 takes 4 minibatches a period, worker 1 two; worker 0's second applied push comes
    # after one rejected one (skip 1), whose period used up 4 more of its minibatches, not n_sync's 4 of worker 1's 2.
    from helpers.problems import simulate_clean

    trace = delays.Trace([0, 1, 0, 1], skips=[0, 0, 1, 0], steps=[4, 2], num=2)
    result = simulate_clean(rules.diloco(0.5), trace, 4, n_sync=4, push="delta", local_lr=0.05)
    assert np.asarray(result.state.data.taken).tolist() == [4 + 2 * 4, 2 + 2]
    trace = delays.Trace([1, 0, 1], skips=[0, 0, 1], steps=[4, 2], num=2)  # (worker 1's skip: 2 of its own)
    result = simulate_clean(rules.diloco(0.5), trace, 3, n_sync=4, push="delta", local_lr=0.05)
    assert np.asarray(result.state.data.taken).tolist() == [4, 2 + 2 * 2]


def test_a_rejected_nan_push_leaves_the_workers_adamw_state_as_it_was_and_the_run_replays(tmp_path, monkeypatch):
    # One example is NaN: the period that reads it pushes a NaN delta, which the store rejects. A pipelined store
    # answers before it knows, so the worker keeps its new AdamW state only where its own check found the push finite:
    # with the NaN moments kept, every later push was NaN and the run stopped as diverged.
    from helpers.problems import DATA, W0, lsq_loss, simulate_clean

    from asgd_jax.plan import Plan
    from asgd_jax.trainer import TrainConfig, train

    data = {k: v.copy() for k, v in DATA.items()}
    data["x"][5] = np.nan
    sync = dict(n_sync=3, push="delta", local_lr=0.02, inner="adamw")
    config = TrainConfig(Plan(2, num_updates=10, batch_size=4, **sync), seed=5, out=str(tmp_path), progress=False)
    _in_lockstep(monkeypatch, 2, period=3, pushes=10)  # (the rejected worker pushes again, however fast the other)
    result = train(lsq_loss, rules.diloco(0.5), W0, data, config, devices=jax.devices()[:2])
    assert result.pushes_applied == 10 and result.pushes_rejected >= 1 and np.isfinite(result.params).all()
    records = [json.loads(line) for line in pathlib.Path(result.trace_path).read_text().splitlines()]
    first = next(i for i, r in enumerate(records) if r.get("rejected"))
    worker = records[first]["worker"]  # (its next pushes are applied: its AdamW state was not the NaN one)
    assert any(r["worker"] == worker and not r.get("rejected") for r in records[first + 1 :]), records
    trace = delays.Trace.load(result.trace_path, num=2)
    replay = simulate_clean(rules.diloco(0.5), trace, 10, key=5, **sync)
    np.testing.assert_allclose(replay.params, result.params, rtol=1e-5, atol=1e-6)


def _in_lockstep(monkeypatch, workers: int, period: int, pushes: int) -> None:
    """In a threaded run, a worker takes the minibatches of its period p + 1 only once every worker has pushed p times,
    until ``pushes`` pushes have been made (the run may then be over: nobody waits for a worker that stopped)."""
    import threading

    from asgd_jax.trainer.endpoint import Endpoint
    from asgd_jax.trainer.loader import ShardLoader

    take, counts, changed = ShardLoader.__next__, [0] * workers, threading.Condition()

    def gated_take(self):
        with changed:
            changed.wait_for(lambda: min(counts) >= self.taken // period or sum(counts) >= pushes, timeout=60)
        return take(self)

    def noted(push):  # (a worker on the store's device pushes computed pushes)
        def noted_push(self, worker, *args, **kwargs):
            answer = push(self, worker, *args, **kwargs)
            with changed:
                counts[worker] += 1
                changed.notify_all()
            return answer

        return noted_push

    monkeypatch.setattr(ShardLoader, "__next__", gated_take)
    monkeypatch.setattr(Endpoint, "push", noted(Endpoint.push))
    monkeypatch.setattr(Endpoint, "push_computed", noted(Endpoint.push_computed))
