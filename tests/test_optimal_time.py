"""The optimal-time methods (Ringmaster ASGD, Rennala SGD, m-Synchronous SGD, Koloskova's delay threshold) and the
compute-time laws: against float64 NumPy event loops written from the papers, the papers' exact anchors, the memory
a thousand workers need, and what compiles."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import optimal_time as ref
from helpers.compiles import compilations
from helpers.problems import NOISY, W1, crash_at, lsq_loss, simulate_lsq
from hypothesis import given, settings
from hypothesis import strategies as st

import asgd_jax
from asgd_jax import delays, studies
from asgd_jax.experiments import optimal_time

TIMES = delays.sqrt_times(6)  # 2, 2.41, 2.73, 3, 3.24, 3.45: the papers' 1 + sqrt(i)
LAW = delays.Workers.with_times(TIMES)
SGD = asgd_jax.rules.get("sgd", 0.05)


def _close(result, params, times):
    np.testing.assert_allclose(np.asarray(result.params), params, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(result.metrics["time"], times, rtol=1e-5)


@pytest.mark.parametrize("stops", [False, True])
@pytest.mark.parametrize("threshold", [1, 3])
def test_ringmaster_is_the_papers_algorithm(threshold, stops):
    result = simulate_lsq(SGD, delays.Ringmaster(LAW, threshold, stops=stops), num_updates=40)
    params, out, taken = ref.ringmaster(TIMES, threshold, 0.05, 40, stops=stops)
    np.testing.assert_array_equal(result.metrics["staleness"], out["staleness"])
    np.testing.assert_array_equal(result.metrics["worker"], out["worker"])
    assert result.metrics["staleness"].max() < threshold  # an ignored gradient never counts as an update
    _close(result, params, out["time"])
    np.testing.assert_allclose(result.metrics["busy"], out["busy"], rtol=1e-5)
    np.testing.assert_allclose(result.metrics["wasted"], out["wasted"], rtol=1e-5, atol=1e-4)
    # The minibatches: an ignored gradient used its worker's next one (a skip), a stopped computation did not.
    skipped = np.asarray(result.state.delay.skips)
    np.testing.assert_array_equal(np.asarray(result.state.data.taken) + skipped, taken)


@pytest.mark.parametrize("stops", [False, True])
@pytest.mark.parametrize("batch", [1, 4])
def test_rennala_is_the_papers_algorithm(batch, stops):
    result = simulate_lsq(SGD, delays.Rennala(LAW, batch, stops=stops), num_updates=30)
    params, out, taken = ref.rennala(TIMES, batch, 0.05, 30, stops=stops)
    _close(result, params, out["time"])
    np.testing.assert_array_equal(result.metrics["staleness"], 0)  # every used gradient is computed at x^k
    np.testing.assert_allclose(result.metrics["busy"], out["busy"], rtol=1e-5)
    np.testing.assert_allclose(result.metrics["wasted"], out["wasted"], rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(result.state.data.taken + result.state.delay.skips), taken)


def test_rennala_without_stops_follows_a_hand_computed_schedule():
    """Times 3, 4, 7, S = 2, no stops, by hand: a worker always begins at the newest iterate (the one whose gradient
    closes round k at x^{k+1}), a gradient computed at an older one is ignored; ties go to the lower id (at 12, 21
    and 24, exact with integer times). Round by round: its workers, their skips (ignored gradients just before), the
    clock, the busy and the wasted time. The closing worker restarting at x^k instead made its next gradient an
    ignored one: round 1 ended at 12 (not 9) with workers [0, 0], 14 of 27 wasted."""
    model = delays.Rennala(delays.Workers.with_times([3, 4, 7]), 2)
    shards = [[0, 1], [1, 0], [0, 0], [0, 1], [0, 1]]
    skips = [[0, 0], [0, 1], [0, 0], [0, 2], [1, 0]]  # ignored: w0 at 6, 21; w1 at 12, 16; w2 at 7, 14, 21
    times, busy, wasted = [4, 9, 15, 20, 24], [7, 24, 41, 52, 69], [0, 10, 21, 25, 35]
    s, step = model.init(jax.random.key(0)), jax.jit(model.round)
    for t in range(5):
        s, r = step(s, t, jax.random.key(t))
        assert np.asarray(r.shards).tolist() == shards[t] and np.asarray(r.skips).tolist() == skips[t], t
        assert (float(r.time), float(r.busy), float(r.wasted)) == (times[t], busy[t], wasted[t]), t
    assert np.asarray(s.skips).tolist() == [0, 0, 3]  # w2's three ignored gradients, still pending
    result = simulate_lsq(SGD, model, num_updates=5)  # the simulator runs the same schedule
    np.testing.assert_array_equal(result.metrics["time"], times)
    np.testing.assert_array_equal(result.metrics["busy"], busy)
    np.testing.assert_array_equal(result.metrics["wasted"], wasted)
    # Minibatches: every arrival used one (w0 arrived 8 times, w1 6, w2 3), ignored or not.
    np.testing.assert_array_equal(np.asarray(result.state.data.taken + result.state.delay.skips), [8, 6, 3])


_RANDOM = delays.Workers(5, compute_time="lognormal", sigma=1.0, noise=0.3)


@pytest.mark.parametrize(
    "model",
    [delays.Ringmaster(_RANDOM, 2, stops=True), delays.Rennala(_RANDOM, 3, stops=True), delays.Ringmaster(_RANDOM, 2)],
    ids=["ringmaster-stops", "rennala-stops", "ringmaster"],
)
def test_every_computation_takes_its_workers_next_time_a_restart_included(model):
    """Under a random law, the c-th computation worker w begins (a restart after a stop included) lasts
    ``computation_time(law, key, w, c)``: a stopped computation draws anew, it does not keep the time it had drawn."""
    key = jax.random.key(3)
    step = jax.jit(model.round if delays.is_round_model(model) else model.next)
    s = model.init(key)
    for t in range(60):
        s, _ = step(s, t, jax.random.key(t))
        # Every worker's computation in progress is its latest: number begun[w] - 1 of its sequence.
        drawn = [float(delays.computation_time(_RANDOM, key, w, int(c) - 1)) for w, c in enumerate(s.begun)]
        np.testing.assert_allclose(np.asarray(s.finish - s.began), drawn, rtol=1e-5, atol=1e-5, err_msg=str(t))
    used = 60 * (model.batch if delays.is_round_model(model) else 1)
    assert int(s.begun.sum()) > used + 5  # restarts (stops or ignored gradients) happened


def test_with_stops_every_update_waits_for_the_first_of_fresh_draws():
    """Exponential times, mean 1, M = 4, with stops and R = 1 (S = 1): after each update every other computation is
    stopped and begins anew, so an update takes the first of four fresh exponential times: 1/4 on average, median
    ln(2)/4 (the papers' model). A restart that kept its drawn time kept the long ones: 1.0 on average. Ringmaster
    with R = 1 and Rennala with S = 1 are then one algorithm, and each worker's c-th computation takes its c-th time in
    both: the same clock bit for bit."""
    ring = simulate_lsq(SGD, delays.Ringmaster(4, 1, stops=True), num_updates=4000, batch_size=1)
    rounds = simulate_lsq(SGD, delays.Rennala(4, 1, stops=True), num_updates=4000, batch_size=1)
    np.testing.assert_array_equal(ring.metrics["time"], rounds.metrics["time"])
    gaps = np.diff(ring.metrics["time"], prepend=0.0)
    assert abs(gaps.mean() - 0.25) < 0.02  # the std of the mean: 0.25 / sqrt(4000) = 0.004
    assert abs(np.median(gaps) - 0.25 * np.log(2)) < 0.02


@pytest.mark.parametrize("m", [1, 4])
def test_m_synchronous_is_the_papers_algorithm(m):
    result = simulate_lsq(SGD, delays.MSync(LAW, m), num_updates=25)
    params, out, taken = ref.m_synchronous(TIMES, m, 0.05, 25)
    _close(result, params, out["time"])
    np.testing.assert_array_equal(np.asarray(result.state.data.taken), taken)
    wasted = (len(TIMES) - m) * TIMES[m - 1] * np.arange(1, 26)  # the M - m stopped, every round
    np.testing.assert_allclose(result.metrics["wasted"], wasted, rtol=1e-5)


def test_m_synchronous_with_every_worker_is_ssgd_bit_for_bit():
    law = delays.Workers(5, compute_time="lognormal", straggler_prob=0.2)
    a = simulate_lsq(SGD, delays.MSync(law, 5), num_updates=30, key=4)
    b = simulate_lsq(SGD, law, num_updates=30, key=4, mode="sync")
    np.testing.assert_array_equal(np.asarray(a.params), np.asarray(b.params))
    for name in ("loss", "time", "staleness", "epoch", "worker"):
        np.testing.assert_array_equal(a.metrics[name], b.metrics[name])
    np.testing.assert_array_equal(np.asarray(a.state.data.taken), np.asarray(b.state.data.taken))


@pytest.mark.parametrize("batch", [1, 5, 13])
def test_a_rennala_round_with_stops_takes_exactly_t_s(batch):
    """Tyurin & Richtárik: with fixed times and restarts, one step takes T_S = min{t : sum_i floor(t/tau_i) >= S}."""
    result = simulate_lsq(SGD, delays.Rennala(LAW, batch, stops=True), num_updates=12)
    t_s = ref.rennala_round_time(TIMES, batch)
    np.testing.assert_allclose(np.diff(result.metrics["time"], prepend=0.0), t_s, rtol=1e-5)


@pytest.mark.parametrize(("m", "threshold"), [(16, 2), (64, 4), (64, 16)])
def test_ringmaster_with_stops_keeps_lemma_4_1(m, threshold):
    """Any R consecutive updates of Ringmaster with stops finish within 2 min_m H_m (1 + R/m) (fixed times)."""
    times = delays.sqrt_times(m)
    model = delays.Ringmaster(delays.Workers.with_times(times), threshold, stops=True)
    result = simulate_lsq(SGD, model, num_updates=400, batch_size=1)
    clock = np.concatenate([[0.0], result.metrics["time"]])
    span = clock[threshold:] - clock[:-threshold]
    assert span.max() <= ref.ringmaster_bound(times, threshold) * (1 + 1e-6)
    assert result.metrics["staleness"].max() < threshold


def test_a_thousand_workers_keep_only_what_the_rule_needs():
    """M = 1,000: Ringmaster keeps R weight versions, Rennala and m-Synchronous one; nothing per worker but times."""
    law = delays.Workers.with_times(delays.sqrt_times(1000), noise=0.1)
    data = jax.tree.map(lambda a: np.concatenate([a] * 21), NOISY)  # 2,016 examples: two per worker's shard
    for model, copies in [(delays.Ringmaster(law, 6), 6), (delays.Rennala(law, 8), 1), (delays.MSync(law, 100), 1)]:
        plan = asgd_jax.Plan(model, num_updates=50, batch_size=1)
        result = asgd_jax.simulate(lsq_loss, SGD, jnp.asarray(W1), data, plan, key=jax.random.key(0), progress=False)
        assert result.state.server.backup_params.shape == (copies, W1.size)
        assert np.isfinite(np.asarray(result.params)).all()
        assert result.metrics["busy"][-1] > result.metrics["time"][-1]  # many workers' work, wasted included


def test_the_cluster_numbers_and_the_learning_rate_are_arguments():
    """Other times, noise, learning rate or seed run in the same programs; R (the ring's size) is structure."""
    models = [delays.Workers.with_times(TIMES * f, noise=n) for f, n in [(1.0, 0.1), (2.0, 0.3)]]
    simulate_lsq(SGD, delays.Ringmaster(models[0], 3), num_updates=20)
    with compilations() as compiled:
        simulate_lsq(asgd_jax.rules.get("sgd", 0.2), delays.Ringmaster(models[1], 3), num_updates=20, key=5)
    assert not [n for n in compiled if "simulator" in n]
    with compilations() as compiled:
        simulate_lsq(SGD, delays.Ringmaster(models[1], 4), num_updates=20)
    assert [n for n in compiled if "simulator_chunk" in n]


def test_koloskova_step_is_theorem_8():
    """eta for tau <= M, else min(eta, c / tau); c = 0 drops the gradient (a zero update)."""
    rule = asgd_jax.rules.get("delay_threshold", 0.1, num_workers=4, max_step=0.5)
    state = rule.init(jnp.zeros(2))
    g = jnp.array([1.0, -2.0])
    for tau, step in [(0, 0.1), (4, 0.1), (5, 0.1), (6, 0.5 / 6), (50, 0.01)]:
        np.testing.assert_allclose(rule.update(g, state, staleness=tau)[0], -step * np.asarray(g), rtol=1e-6)
    drop = asgd_jax.rules.get("delay_threshold", 0.1, num_workers=4)
    np.testing.assert_array_equal(drop.update(g, drop.init(g), staleness=5)[0], 0.0)


def test_pareto_and_noise_laws_have_their_means():
    key = jax.random.key(0)
    pareto = delays.Workers(4, compute_time="pareto", alpha=3.0, mean_compute_time=2.0).draw(key, (100_000,))
    assert abs(float(pareto.mean()) - 2.0) < 0.05 and float(pareto.min()) >= 2.0 * 2 / 3 * (1 - 1e-6)
    noisy = delays.Workers.with_times([1.0, 3.0], noise=[0.0, 0.5]).draw(key, (100_000,))
    np.testing.assert_allclose(noisy[:, 0], 1.0, rtol=1e-6)
    assert abs(float(noisy[:, 1].mean()) - (3.0 + 0.5 * np.sqrt(2 / np.pi))) < 0.01


@settings(max_examples=25, deadline=None)
@given(
    value=st.one_of(
        st.integers(-3, 0),
        st.floats(max_value=-1e-3),
        st.sampled_from([float("nan"), float("inf")]),
        st.text(max_size=2),
        st.none(),
        st.booleans(),
    ),
    which=st.sampled_from(["threshold", "batch", "m", "times", "noise", "alpha"]),
)
def test_bad_cluster_arguments_are_config_errors(value, which):
    """Every refused argument is a ConfigError that names it, before anything is drawn or compiled."""
    make = {
        "threshold": lambda v: delays.Ringmaster(LAW, v),
        "batch": lambda v: delays.Rennala(LAW, v),
        "m": lambda v: delays.MSync(LAW, v),
        "times": lambda v: delays.Workers.with_times(v),
        "noise": lambda v: delays.Workers(3, noise=v),
        "alpha": lambda v: delays.Workers(3, compute_time="pareto", alpha=v),
    }[which]
    if which in ("noise",) and isinstance(value, int | float) and not isinstance(value, bool) and value == 0:
        return  # no noise is allowed
    with compilations() as compiled, pytest.raises(asgd_jax.ConfigError, match=which):
        make(value)
    assert not compiled


def test_m_above_the_workers_a_round_model_with_local_steps_and_a_drawn_delay_on_the_trainer_are_refused():
    with pytest.raises(asgd_jax.ConfigError, match="m <= M"):
        delays.MSync(LAW, 7)
    with pytest.raises(asgd_jax.ConfigError, match="n_sync=1"):
        asgd_jax.Plan(delays.Rennala(LAW, 2), n_sync=2, push="accumulate")
    with pytest.raises(asgd_jax.ConfigError, match="the trainer runs M real workers"):  # a delay drawn, not measured
        asgd_jax.TrainConfig(asgd_jax.Plan(delays.FixedDelay(2)))
    with pytest.raises(asgd_jax.ConfigError, match="timeout"):  # virtual time is the simulator's
        asgd_jax.TrainConfig(asgd_jax.Plan(4, time_budget=10.0))


def _noisy_loss(w, _):
    return {"loss": lsq_loss(w, NOISY)}


@pytest.mark.parametrize(
    "model", [delays.Ringmaster(LAW, 2, stops=True), delays.Rennala(LAW, 3)], ids=["ringmaster", "rennala"]
)
def test_a_killed_run_with_stops_resumes_to_the_same_bits(tmp_path, model):
    """The cluster's state (times, versions, pending skips, busy time) is in the checkpoint like any delay state."""
    common = dict(num_updates=40, eval_fn=_noisy_loss, eval_every=10)  # one eval_fn: its program compiles once
    full = simulate_lsq(SGD, model, **common)

    with pytest.raises(KeyboardInterrupt):
        simulate_lsq(SGD, model, checkpoint_dir=tmp_path, callback=crash_at(20), **common)
    resumed = simulate_lsq(SGD, model, checkpoint_dir=tmp_path, **common)
    np.testing.assert_array_equal(np.asarray(resumed.params), np.asarray(full.params))
    for name in full.metrics:
        np.testing.assert_array_equal(resumed.metrics[name], full.metrics[name], err_msg=name)


def test_a_sweep_of_a_cluster_is_its_runs_alone():
    model = delays.Ringmaster(delays.Workers.with_times(TIMES, noise=0.2), 3)
    plan = asgd_jax.Plan(model, num_updates=30, batch_size=8)
    keys, hp = asgd_jax.grid(seeds=[0, 1], learning_rate=[0.02, 0.05])
    rule = asgd_jax.rules.get("sgd", 0.05)
    swept = asgd_jax.sweep(lsq_loss, rule, jnp.asarray(W1), NOISY, plan, keys=keys, hparams=hp, progress=False)
    for r in range(4):
        alone = asgd_jax.simulate(
            lsq_loss,
            asgd_jax.rules.get("sgd", float(hp["learning_rate"][r])),
            jnp.asarray(W1),
            NOISY,
            plan,
            key=keys[r],
            progress=False,
        )
        np.testing.assert_array_equal(swept.metrics["worker"][r], alone.metrics["worker"])
        np.testing.assert_array_equal(swept.metrics["time"][r], alone.metrics["time"])
        np.testing.assert_allclose(swept.params[r], alone.params, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------------------------
# The optimal_time study: its own problem, a virtual-time budget, picks by time to target, the theory's curve.
# --------------------------------------------------------------------------------------------------------------------


def test_time_to_target_counts_only_a_crossing_within_the_budget():
    times, errors = np.array([1.0, 2.0, 3.0]), np.array([0.9, 0.6, 0.4])
    assert studies.time_to_target(times, errors, 0.5) == 3.0
    assert np.isnan(studies.time_to_target(times, errors, 0.5, budget=2.5))


@pytest.fixture(scope="session")  # (not module: a worker interleaves other modules)
def optimal_time_run():
    """The study's nine methods on one cell, each with one of Ringmaster's thresholds and Rennala's batches (every
    value is a structure, two programs to compile: the study's four each were 12 of its 20 arms, what the tests of
    this fixture read is the same with one)."""
    study = studies.load("optimal_time")
    settings = dataclasses.replace(study.quick, workers=(4,), seeds=(0,), time_budget=40.0, target_error=0.05)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(optimal_time, "THRESHOLDS", (4,))
        patch.setattr(optimal_time, "BATCHES", (4,))
        return study, studies.run(study, settings=settings, progress=False)


@pytest.mark.xdist_group("optimal_time_run")  # one worker runs the study once
def test_the_optimal_time_study_gives_every_method_its_time_budget(optimal_time_run):
    _, result = optimal_time_run
    labels = {r["label"] for r in result.runs}
    assert labels == {
        "ASGD",
        "Delay-adaptive (Mishchenko)",
        "Delay-adaptive (Koloskova)",
        "Ringmaster",
        "Ringmaster (stops)",
        "Rennala",
        "Rennala (stops)",
        "m-Synchronous",
        "Minibatch SGD",
    }
    # Every run lasts the budget (no cluster applies more than sum_i 1/tau_i gradients per unit of time), and no time
    # to target lies beyond it.
    assert min(r["virtual_time"] for r in result.runs) >= result.settings.time_budget
    reached = [r["time_to_target"] for r in result.runs if np.isfinite(r["time_to_target"])]
    assert reached and max(reached) <= result.settings.time_budget


@pytest.mark.xdist_group("optimal_time_run")  # one worker runs the study once
def test_the_optimal_time_study_picks_by_time_to_target(optimal_time_run):
    study, result = optimal_time_run
    _, picks = studies.best_tuned(study, result.runs)
    for (_, m, label), pick in picks.items():
        cell = [r for r in result.runs if r["label"] == label and r["M"] == m]
        best = min(cell, key=lambda r: r["time_to_target"] if np.isfinite(r["time_to_target"]) else np.inf)
        if np.isfinite(best["time_to_target"]):
            assert pick["lr"] == best["lr"] and all(pick.get(k) == best.get(k) for k in ("R", "S", "m"))


@pytest.mark.xdist_group("optimal_time_run")  # one worker runs the study once
def test_the_optimal_time_curve_is_the_harmonic_bound(optimal_time_run):
    study, result = optimal_time_run
    _, curve = study.paper.prediction(result.settings, [4, 16])
    times = delays.sqrt_times(16)
    s2_eps = 32 * 1.0**2 / result.settings.target_error
    direct = min(m / np.sum(1 / times[:m]) * (1 + s2_eps / m) for m in range(1, 17))
    np.testing.assert_allclose(curve[16], direct, rtol=1e-12)
    assert curve[16] < curve[4]  # more workers, less time: the bound keeps falling


def test_a_time_budget_ends_the_runs_at_the_first_evaluation_past_it(tmp_path):
    """``Plan(time_budget=)``: the sweep ends at the first evaluation where every run's clock has reached it."""
    eval_fn = lambda w, _: {"loss": lsq_loss(w, NOISY)}
    plan = asgd_jax.Plan(delays.Workers.with_times(TIMES), num_updates=400, batch_size=8, eval_every=20)
    budget = plan.replace(time_budget=30.0)
    full = asgd_jax.simulate(lsq_loss, SGD, jnp.asarray(W1), NOISY, plan, eval_fn=eval_fn, progress=False)
    cut = asgd_jax.simulate(lsq_loss, SGD, jnp.asarray(W1), NOISY, budget, eval_fn=eval_fn, progress=False)
    n = len(cut.metrics["time"])
    assert n % 20 == 0 and cut.metrics["time"][-1] >= 30.0 > cut.metrics["time"][n - 21]
    np.testing.assert_array_equal(cut.metrics["time"], full.metrics["time"][:n])  # the same run, cut
    assert cut.metrics["eval_update"][-1] == n
    assert budget.structure() == plan.structure()  # a number: the same programs

    options = dict(eval_fn=eval_fn, progress=False, checkpoint_dir=tmp_path)
    with pytest.raises(KeyboardInterrupt):
        asgd_jax.simulate(lsq_loss, SGD, jnp.asarray(W1), NOISY, budget, callback=crash_at(20), **options)
    resumed = asgd_jax.simulate(lsq_loss, SGD, jnp.asarray(W1), NOISY, budget, **options)
    np.testing.assert_array_equal(resumed.metrics["time"], cut.metrics["time"])  # killed and resumed: the same cut
    again = asgd_jax.simulate(lsq_loss, SGD, jnp.asarray(W1), NOISY, budget, **options)  # a finished run: nothing more
    np.testing.assert_array_equal(again.metrics["time"], cut.metrics["time"])
