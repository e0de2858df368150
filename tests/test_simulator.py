"""The staleness simulator: against an independent reference, and the properties ARCHITECTURE.md lists as invariants."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.problems import DIM, B, BatchOrder, N, crash_at, lsq_loss, simulate_lsq
from helpers.problems import NOISY as DATA
from helpers.problems import W1 as W0
from helpers.reference import ReferenceServer, lsq_grad

import asgd_jax
from asgd_jax import delays
from asgd_jax.errors import ConfigError

RULES = {
    "asgd": (lambda: asgd_jax.asgd(0.05), {"lam": None}),
    "dc_asgd_c": (lambda: asgd_jax.dc_asgd(0.05, 0.5), {"lam": 0.5}),
    "dc_asgd_a": (lambda: asgd_jax.dc_asgd(0.05, 2.0, adaptive=True), {"lam": 2.0, "adaptive": True}),
}


# --------------------------------------------------------------------------------------------------------------------
# Against the NumPy reference of the paper's server.
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule_name", RULES)
def test_trace_matches_numpy_reference(rule_name):
    make_rule, ref_kwargs = RULES[rule_name]
    order = np.random.default_rng(2).integers(0, 3, size=60)
    result = simulate_lsq(make_rule(), delays.Trace(order, num=3), num_updates=60)

    ref = ReferenceServer(W0, 3, 0.05, **ref_kwargs)
    batches = BatchOrder(0, num_shards=3)
    for worker in order:
        a, y = batches.next(int(worker))
        ref.push(int(worker), lsq_grad(ref.backup[worker], a, y))
        ref.pull(int(worker))
    np.testing.assert_array_equal(result.metrics["staleness"], ref.staleness)
    np.testing.assert_array_equal(result.metrics["worker"], order)
    np.testing.assert_allclose(result.params, ref.w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rule_name", RULES)
@pytest.mark.parametrize("tau", [0, 3])
def test_fixed_delay_matches_numpy_reference(rule_name, tau):
    make_rule, ref_kwargs = RULES[rule_name]
    num_updates = 50
    result = simulate_lsq(make_rule(), delays.FixedDelay(tau), num_updates=num_updates)

    # Independent reference: gradient of update t at w_{max(0, t - tau)}; one data stream; per-"worker" state is the
    # round-robin slot (t - tau) mod (tau + 1), which is what MeanSquare-per-worker would see.
    lr, lam, adaptive = 0.05, ref_kwargs["lam"], ref_kwargs.get("adaptive", False)
    history = [W0.astype(np.float64)]
    ms = np.zeros(DIM)
    batches = BatchOrder(0, num_shards=1)
    for t in range(num_updates):
        w_bak = history[max(0, t - tau)]
        a, y = batches.next(0)
        g = lsq_grad(w_bak, a, y)
        w = history[-1]
        if lam is not None:
            lam_t = lam
            if adaptive:
                ms = 0.95 * ms + 0.05 * g * g
                lam_t = lam / np.sqrt(ms + 1e-7)
            g = g + lam_t * g * g * (w - w_bak)
        history.append(w - lr * g)
    np.testing.assert_allclose(result.params, history[-1], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(result.metrics["staleness"], np.minimum(np.arange(num_updates), tau))


def test_one_worker_equals_sequential_sgd():
    result = simulate_lsq(asgd_jax.asgd(0.05, momentum=0.5), delays.Workers(1), num_updates=30)
    rule = asgd_jax.asgd(0.05, momentum=0.5)
    w, state = jnp.asarray(W0), rule.init(jnp.asarray(W0))
    batches = BatchOrder(0, num_shards=1)
    for _ in range(30):
        a, y = batches.next(0)
        g = jax.grad(lsq_loss)(w, {"x": jnp.asarray(a, jnp.float32), "y": jnp.asarray(y, jnp.float32)})
        updates, state = rule.update(g, state, w)
        w = w + updates
    np.testing.assert_allclose(result.params, w, rtol=1e-5, atol=1e-6)
    assert not result.metrics["staleness"].any()


def test_sync_mode_averages_the_workers_gradients_at_the_same_weights():
    m, lr = 3, 0.05
    result = simulate_lsq(
        asgd_jax.dc_asgd(lr, 4.0), delays.Workers(m, compute_time="constant"), num_updates=12, mode="sync"
    )
    w = W0.astype(np.float64)
    batches = BatchOrder(0, num_shards=m)
    for _ in range(12):
        g = np.mean([lsq_grad(w, *batches.next(s)) for s in range(m)], axis=0)
        w = w - lr * g  # no staleness, so DC-ASGD adds nothing
    np.testing.assert_allclose(result.params, w, rtol=1e-5, atol=1e-6)
    assert not result.metrics["staleness"].any()
    np.testing.assert_allclose(result.metrics["time"], np.arange(1, 13))  # one round of constant time 1 each
    np.testing.assert_allclose(result.metrics["epoch"][-1], 12 * m * B / N)


# --------------------------------------------------------------------------------------------------------------------
# n_sync and the three push modes (one worker makes them exactly checkable).
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("push", ["gradients", "delta", "accumulate"])
def test_n_sync_push_modes(push):
    k, lr_local, lr_server, updates = 3, 0.05, 0.5, 6
    rule = asgd_jax.asgd(lr_server)
    result = simulate_lsq(rule, delays.Workers(1), num_updates=updates, n_sync=k, push=push, local_lr=lr_local)
    w = W0.astype(np.float64)
    batches = BatchOrder(0, num_shards=1)
    for _ in range(updates):
        local, acc = w.copy(), np.zeros(DIM)
        for _ in range(k):
            g = lsq_grad(local if push != "accumulate" else w, *batches.next(0))
            acc += g
            if push != "accumulate":
                local = local - lr_local * g
        payload = (w - local) if push == "delta" else acc
        w = w - lr_server * payload
    np.testing.assert_allclose(result.params, w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.metrics["epoch"][-1], updates * k * B / N)


def test_delta_push_with_unit_server_lr_is_local_sgd():
    # M = 1, push the delta, server lr 1: exactly n_sync * U steps of plain SGD at the local learning rate.
    a = simulate_lsq(asgd_jax.asgd(1.0), delays.Workers(1), num_updates=5, n_sync=4, push="delta", local_lr=0.05)
    b = simulate_lsq(asgd_jax.asgd(0.05), delays.Workers(1), num_updates=20)
    np.testing.assert_allclose(a.params, b.params, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------------------------
# Determinism, vmap, resume.
# --------------------------------------------------------------------------------------------------------------------


def test_same_key_gives_identical_bits_and_other_keys_differ():
    rule = asgd_jax.dc_asgd(0.05, 2.0, adaptive=True)
    a = simulate_lsq(rule, delays.Workers(4), num_updates=60, key=3)
    b = simulate_lsq(rule, delays.Workers(4), num_updates=60, key=3)
    c = simulate_lsq(rule, delays.Workers(4), num_updates=60, key=4)
    np.testing.assert_array_equal(a.params, b.params)
    for name in a.metrics:
        np.testing.assert_array_equal(a.metrics[name], b.metrics[name])
    assert not np.array_equal(a.metrics["worker"], c.metrics["worker"])


def test_sweep_equals_separate_runs():
    keys, hp = asgd_jax.grid(seeds=[0, 1], lam=[0.0, 2.0])
    rule_fn = lambda h: asgd_jax.dc_asgd(0.05, h["lam"], adaptive=True)
    plan = asgd_jax.Plan(delays.Workers(4), batch_size=B, num_updates=50)
    swept = asgd_jax.sweep(lsq_loss, rule_fn, jnp.asarray(W0), DATA, plan, keys=keys, hparams=hp, progress=False)
    assert swept.params.shape == (4, DIM)
    for r, (seed, lam) in enumerate([(0, 0.0), (0, 2.0), (1, 0.0), (1, 2.0)]):
        alone = simulate_lsq(asgd_jax.dc_asgd(0.05, lam, adaptive=True), delays.Workers(4), num_updates=50, key=seed)
        np.testing.assert_allclose(swept.params[r], alone.params, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(swept.metrics["worker"][r], alone.metrics["worker"])
        np.testing.assert_array_equal(swept.metrics["staleness"][r], alone.metrics["staleness"])


def test_sweep_over_delay_parameters_equals_separate_runs():
    keys, hp = asgd_jax.grid(seeds=[0], p=[0.0, 0.5], mean=[1.0, 3.0])
    make = lambda p, mean: delays.Workers(3, straggler_prob=p, mean_compute_time=mean, straggler_slowdown=5.0)
    swept = asgd_jax.sweep(
        lsq_loss,
        lambda h: asgd_jax.asgd(0.05),
        jnp.asarray(W0),
        DATA,
        asgd_jax.Plan(make(0.5, 1.0), batch_size=B, num_updates=40),
        keys=keys,
        hparams=hp,
        delays_fn=lambda h: make(h["p"], h["mean"]),
        progress=False,
    )
    for r in range(4):
        p, mean = float(hp["p"][r]), float(hp["mean"][r])
        alone = simulate_lsq(asgd_jax.asgd(0.05), make(p, mean), num_updates=40)
        np.testing.assert_array_equal(swept.metrics["worker"][r], alone.metrics["worker"])
        np.testing.assert_allclose(swept.metrics["time"][r], alone.metrics["time"], rtol=1e-6)
        np.testing.assert_allclose(swept.params[r], alone.params, rtol=1e-5, atol=1e-6)
    # The parameters really vary per run: slower workers take longer in virtual time.
    assert swept.metrics["time"][1, -1] > 2 * swept.metrics["time"][0, -1]


def test_resume_from_checkpoint_is_bit_identical(tmp_path):
    rule = asgd_jax.dc_asgd(0.05, 2.0, adaptive=True, momentum=0.5)
    eval_fn = lambda w, _: {"loss": lsq_loss(w, DATA)}
    common = dict(num_updates=60, eval_fn=eval_fn, eval_every=10)
    full = simulate_lsq(rule, delays.Workers(4), **common)

    with pytest.raises(KeyboardInterrupt):
        simulate_lsq(rule, delays.Workers(4), checkpoint_dir=tmp_path, callback=crash_at(30), **common)
    resumed = simulate_lsq(rule, delays.Workers(4), checkpoint_dir=tmp_path, **common)
    np.testing.assert_array_equal(resumed.params, full.params)
    assert set(resumed.metrics) == set(full.metrics)
    for name in full.metrics:
        np.testing.assert_array_equal(resumed.metrics[name], full.metrics[name], err_msg=name)
    np.testing.assert_array_equal(full.metrics["eval_update"], [0, 10, 20, 30, 40, 50, 60])

    with pytest.raises(ValueError, match="key"):  # a checkpoint of another run is refused, not silently mixed in
        simulate_lsq(rule, delays.Workers(4), checkpoint_dir=tmp_path, key=9, **common)


def test_a_resume_with_other_settings_is_refused_naming_what_changed(tmp_path):
    rule = asgd_jax.asgd(0.05)
    with pytest.raises(KeyboardInterrupt):
        simulate_lsq(rule, delays.Workers(4), num_updates=40, chunk=10, checkpoint_dir=tmp_path, callback=crash_at(20))
    with pytest.raises(ConfigError, match=r"different num_updates \(40 then, 60 now\)"):
        simulate_lsq(rule, delays.Workers(4), num_updates=60, chunk=10, checkpoint_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"different plan \(.*batch_size=8.* then, .*batch_size=16.* now\)"):
        simulate_lsq(rule, delays.Workers(4), num_updates=40, chunk=10, checkpoint_dir=tmp_path, batch_size=16)


def test_a_bfloat16_run_resumes_from_its_checkpoint_bit_identical(tmp_path):
    # .npz keeps a bfloat16 leaf as raw bytes (|V2): the checkpoint was refused as "another configuration's".
    rule = asgd_jax.dc_asgd(0.05, 2.0, adaptive=True, momentum=0.5)
    params = jnp.asarray(W0, jnp.bfloat16)
    plan = asgd_jax.Plan(delays.Workers(4), num_updates=40, batch_size=B, chunk=10)
    run = lambda **kw: asgd_jax.simulate(lsq_loss, rule, params, DATA, plan, progress=False, **kw)
    full = run()

    with pytest.raises(KeyboardInterrupt):
        run(checkpoint_dir=tmp_path, callback=crash_at(20))
    resumed = run(checkpoint_dir=tmp_path)
    assert resumed.params.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(resumed.params), np.asarray(full.params))
    np.testing.assert_array_equal(resumed.metrics["loss"], full.metrics["loss"])


def test_evaluation_runs_at_start_and_every_interval():
    eval_fn = lambda w, _: {"loss": lsq_loss(w, DATA)}
    result = simulate_lsq(asgd_jax.asgd(0.05), delays.Workers(2), num_updates=25, eval_fn=eval_fn, eval_every=10)
    np.testing.assert_array_equal(result.metrics["eval_update"], [0, 10, 20, 25])
    np.testing.assert_allclose(result.metrics["eval_loss"][0], lsq_loss(jnp.asarray(W0), DATA), rtol=1e-6)
    np.testing.assert_allclose(result.metrics["eval_loss"][-1], lsq_loss(result.params, DATA), rtol=1e-6)
    assert result.metrics["eval_loss"][-1] < result.metrics["eval_loss"][0]


# --------------------------------------------------------------------------------------------------------------------
# Staleness statistics follow the delay model.
# --------------------------------------------------------------------------------------------------------------------


def test_model_state_workers_use_their_pulled_state_and_server_keeps_the_latest():
    def counting_loss(w, state, batch, key):
        return lsq_loss(w, batch), {"count": state["count"] + 1}

    result = asgd_jax.simulate(
        counting_loss,
        asgd_jax.asgd(0.01),
        jnp.asarray(W0),
        DATA,
        asgd_jax.Plan(delays.Workers(2, compute_time="constant"), batch_size=B, num_updates=7),
        model_state={"count": jnp.int32(0)},
        progress=False,
    )
    # Round robin: the worker pushing update t pulled after update t - 2, so it pushes floor(t / 2) + 1.
    assert int(result.model_state["count"]) == 6 // 2 + 1


# --------------------------------------------------------------------------------------------------------------------
# Errors before compiling.
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: delays.Workers(0), "num=0"),
        (lambda: delays.Workers(2, compute_time="weibull"), "compute_time='weibull'"),
        (lambda: delays.Workers(2, speeds=[1.0]), "speeds"),
        (lambda: delays.Workers(2, straggler_prob=1.5), "straggler_prob"),
        (lambda: delays.FixedDelay(-1), "tau=-1"),
        (lambda: delays.RandomDelay(-2), "max_tau=-2"),
        (lambda: delays.Trace([0, 3], num=2), "contains 3"),
        (lambda: delays.Trace([0, -1]), "-1"),
        (lambda: delays.Trace([]), "worker_ids"),
        (lambda: simulate_lsq(asgd_jax.asgd(0.1), delays.Workers(20), batch_size=8), "batch_size=8"),
        (lambda: simulate_lsq(asgd_jax.asgd(0.1), delays.Workers(2), n_sync=0), "n_sync=0"),
        (lambda: simulate_lsq(asgd_jax.asgd(0.1), delays.Workers(2), mode="semi"), "mode='semi'"),
        (lambda: simulate_lsq(asgd_jax.asgd(0.1), delays.Workers(2), push="weights"), "push='weights'"),
        (lambda: simulate_lsq(asgd_jax.asgd(0.1), delays.FixedDelay(2), mode="sync"), "sync"),
        (lambda: simulate_lsq(asgd_jax.asgd(0.1), delays.Workers(2), n_sync=2), "local_lr"),
        (lambda: simulate_lsq(asgd_jax.asgd(0.1), delays.Workers(2), push="delta"), "local_lr"),
        (lambda: simulate_lsq(asgd_jax.asgd(0.1), delays.Trace([0, 1]), num_updates=5), "num_updates=5"),
        (lambda: simulate_lsq(asgd_jax.asgd(0.1), delays.Workers(2), num_updates=0), "num_updates=0"),
        (lambda: simulate_lsq(asgd_jax.asgd(0.1), delays.Workers(2), batch_size=0), "batch_size=0"),
        (lambda: simulate_lsq(asgd_jax.asgd(0.1), delays.Workers(2), eval_every=5), "eval_fn"),
    ],
)
def test_bad_input_raises_value_error_naming_it(make, match):
    with pytest.raises(ValueError, match=match):
        make()
