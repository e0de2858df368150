"""The update rules: a conformance suite every rule passes, then each rule against its definition."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import asgd_jax


@dataclasses.dataclass(frozen=True)
class Case:
    """A rule as ``factory(**kwargs)`` so it can also be built through ``optax.inject_hyperparams``."""

    factory: Callable[..., optax.GradientTransformation]
    kwargs: dict[str, Any]
    static_args: tuple[str, ...] = ()
    vmap_arg: str = "learning_rate"  # a numeric hyperparameter to vmap over

    def build(self, **override):
        return self.factory(**{**self.kwargs, **override})


def _drop_stale_sgd(learning_rate, max_staleness):
    return optax.chain(asgd_jax.drop_stale(max_staleness), asgd_jax.asgd(learning_rate))


CASES = {
    "asgd": Case(asgd_jax.asgd, {"learning_rate": 0.1}),
    "asgd_momentum": Case(asgd_jax.asgd, {"learning_rate": 0.1, "momentum": 0.9}),
    "dc_asgd_c": Case(asgd_jax.dc_asgd, {"learning_rate": 0.1, "lam": 0.5}, vmap_arg="lam"),
    "dc_asgd_a": Case(asgd_jax.dc_asgd, {"learning_rate": 0.1, "lam": 2.0, "adaptive": True}, vmap_arg="lam"),
    "dc_asgd_a_per_worker": Case(
        asgd_jax.dc_asgd,
        {"learning_rate": 0.1, "lam": 2.0, "adaptive": True, "num_workers": 4},
        static_args=("num_workers",),
        vmap_arg="lam",
    ),
    "dc_asgd_nesterov": Case(
        asgd_jax.dc_asgd, {"learning_rate": 0.1, "lam": 0.5, "momentum": 0.9, "nesterov": True}, vmap_arg="lam"
    ),
    "dc_asgd_schedule": Case(
        asgd_jax.dc_asgd,
        {"learning_rate": optax.piecewise_constant_schedule(0.5, {2: 0.1}), "lam": 0.5},
        vmap_arg="lam",
    ),
    "staleness_aware": Case(asgd_jax.staleness_aware_sgd, {"learning_rate": 0.1}),
    "delay_adaptive": Case(asgd_jax.delay_adaptive_sgd, {"learning_rate": 0.1, "num_workers": 2}),
    "drop_stale": Case(_drop_stale_sgd, {"learning_rate": 0.1, "max_staleness": 3}),
}


def _tree(key, dtype_b=jnp.bfloat16):
    k1, k2 = jax.random.split(key)
    return {"w": jax.random.normal(k1, (3, 2), jnp.float32), "b": jax.random.normal(k2, (2,)).astype(dtype_b)}


PARAMS = _tree(jax.random.key(0))
STALE = _tree(jax.random.key(1))
GRADS = _tree(jax.random.key(2))
EXTRA = {"stale_params": STALE, "staleness": jnp.int32(4), "worker": jnp.int32(1)}


def _steps(rule, n=4, params=PARAMS, grads=GRADS, extra=EXTRA):
    """n updates with the same inputs (state evolves); returns all updates and the last state."""
    state = rule.init(params)
    outs = []
    for _ in range(n):
        updates, state = rule.update(grads, state, params, **extra)
        outs.append(updates)
    return outs, state


def _assert_trees_equal(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def _assert_trees_close(a, b, rtol=1e-6, atol=1e-7):
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(
            np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol, atol=atol
        ),
        a,
        b,
    )


# --------------------------------------------------------------------------------------------------------------------
# Conformance: every rule.
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CASES)
class TestConformance:
    def test_jit_matches_eager_and_is_finite(self, name):
        rule = CASES[name].build()
        eager, _ = _steps(rule)
        state = rule.init(PARAMS)
        update = jax.jit(rule.update)
        for want in eager:
            got, state = update(GRADS, state, PARAMS, **EXTRA)
            _assert_trees_close(got, want)
            assert all(bool(jnp.isfinite(x.astype(jnp.float32)).all()) for x in jax.tree.leaves(got))

    def test_update_keeps_shapes_and_dtypes(self, name):
        rule = CASES[name].build()
        (updates, *_), _ = _steps(rule, n=1)
        assert jax.tree.structure(updates) == jax.tree.structure(GRADS)
        for u, g in zip(jax.tree.leaves(updates), jax.tree.leaves(GRADS), strict=True):
            assert (u.shape, u.dtype) == (g.shape, g.dtype)

    def test_state_type_is_stable(self, name):
        # lax.cond demands identical pytree structure, shapes and dtypes on both branches.
        rule = CASES[name].build()
        state = rule.init(PARAMS)
        _, new_state = rule.update(GRADS, state, PARAMS, **EXTRA)
        jax.lax.cond(True, lambda: state, lambda: new_state)

    def test_no_recompilation(self, name):
        rule = CASES[name].build()
        traces = []

        @jax.jit
        def update(state, worker):
            traces.append(None)
            return rule.update(GRADS, state, PARAMS, **{**EXTRA, "worker": worker})

        _, state = update(rule.init(PARAMS), jnp.int32(0))
        _, state = update(state, jnp.int32(1))
        _, state = update(state, jnp.int32(2))
        assert len(traces) == 1

    def test_inject_hyperparams_is_identical(self, name):
        # float32 only: optax casts injected hyperparameters to the widest param dtype, so a bf16 leaf would be
        # stepped in float32 there (optax's own behaviour, the same for optax.sgd).
        case = CASES[name]
        f32 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)
        extra = {**EXTRA, "stale_params": f32(STALE)}
        args = {"params": f32(PARAMS), "grads": f32(GRADS), "extra": extra}
        plain, _ = _steps(case.build(), **args)
        injected_rule = optax.inject_hyperparams(case.factory, static_args=case.static_args)(**case.kwargs)
        injected, _ = _steps(injected_rule, **args)
        _assert_trees_equal(injected, plain)

    def test_composes_with_clipping_and_weight_decay(self, name):
        rule = CASES[name].build()
        chained = optax.chain(optax.clip_by_global_norm(1.0), optax.add_decayed_weights(1e-2), rule)
        got, _ = _steps(chained)
        clipped, _ = optax.clip_by_global_norm(1.0).update(GRADS, optax.EmptyState())
        decayed = jax.tree.map(lambda g, p: (g + 1e-2 * p).astype(g.dtype), clipped, PARAMS)
        want, _ = _steps(rule, grads=decayed)
        _assert_trees_close(got, want)

    def test_vmaps_over_a_hyperparameter(self, name):
        case = CASES[name]
        values = jnp.asarray([0.0, 0.05, 0.3])
        if case.vmap_arg == "learning_rate" and callable(case.kwargs["learning_rate"]):
            pytest.skip("the learning rate of this case is a schedule")

        def one(v):
            updates, _ = _steps(case.build(**{case.vmap_arg: v}), n=2)
            return updates[-1]

        batched = jax.vmap(one)(values)
        for i in range(len(values)):
            _assert_trees_close(jax.tree.map(lambda x, i=i: x[i], batched), one(values[i]), rtol=1e-6)


# --------------------------------------------------------------------------------------------------------------------
# DC-ASGD against the paper.
# --------------------------------------------------------------------------------------------------------------------


def test_lam_zero_equals_asgd_exactly():
    for adaptive in (False, True):
        dc, _ = _steps(asgd_jax.dc_asgd(0.1, 0.0, adaptive=adaptive, momentum=0.9), n=5)
        plain, _ = _steps(asgd_jax.asgd(0.1, momentum=0.9), n=5)
        _assert_trees_equal(dc, plain)


@pytest.mark.parametrize("adaptive", [False, True])
def test_no_staleness_means_no_correction(adaptive):
    rule = asgd_jax.scale_by_delay_compensation(4.0, adaptive=adaptive)
    updates, _ = rule.update(GRADS, rule.init(PARAMS), PARAMS, stale_params=PARAMS)
    _assert_trees_equal(updates, GRADS)


def test_correction_is_the_taylor_term():
    rule = asgd_jax.scale_by_delay_compensation(0.7)
    g, w, wb = jnp.array([1.0, -2.0, 0.0]), jnp.array([0.5, 1.0, 3.0]), jnp.array([0.0, 2.0, -1.0])
    updates, _ = rule.update(g, rule.init(w), w, stale_params=wb)
    np.testing.assert_allclose(updates, g + 0.7 * g * g * (w - wb), rtol=1e-7)
    assert bool((updates[:2] != g[:2]).all())  # non-zero where g != 0 and the weights moved
    assert updates[2] == 0.0  # g = 0: no correction


def test_adaptive_lambda_uses_the_mean_square_updated_first():
    rule = asgd_jax.scale_by_delay_compensation(2.0, adaptive=True, mean_square_decay=0.9, eps=1e-7)
    g, w, wb = jnp.array([3.0]), jnp.array([1.0]), jnp.array([0.0])
    state = rule.init(w)
    updates, state = rule.update(g, state, w, stale_params=wb)
    ms = 0.1 * 9.0
    np.testing.assert_allclose(state.mean_square, [ms], rtol=1e-6)
    np.testing.assert_allclose(updates, [3.0 + 2.0 / np.sqrt(ms + 1e-7) * 9.0 * 1.0], rtol=1e-6)


def test_traced_adaptive_flag_matches_both_static_variants():
    for flag in (False, True):
        static, _ = _steps(asgd_jax.dc_asgd(0.1, 0.5, adaptive=flag), n=3)
        traced, _ = _steps(asgd_jax.dc_asgd(0.1, 0.5, adaptive=jnp.asarray(flag)), n=3)
        _assert_trees_close(traced, static, rtol=1e-6)


def test_momentum_is_applied_after_compensation():
    lr, lam, mu = 0.1, 0.5, 0.9
    rule = asgd_jax.dc_asgd(lr, lam, momentum=mu)
    w, wb = jnp.array([1.0, 2.0]), jnp.array([0.0, 1.0])
    state = rule.init(w)
    trace = np.zeros(2)
    for g in (jnp.array([1.0, 2.0]), jnp.array([-1.0, 0.5])):
        updates, state = rule.update(g, state, w, stale_params=wb)
        compensated = np.asarray(g) + lam * np.asarray(g) ** 2 * np.asarray(w - wb)
        trace = compensated + mu * trace
        np.testing.assert_allclose(updates, -lr * trace, rtol=1e-6)


# --------------------------------------------------------------------------------------------------------------------
# Staleness-dependent step sizes.
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("tau", "factor"), [(0, 1.0), (1, 1.0), (4, 0.25), (10, 0.1)])
def test_scale_by_staleness(tau, factor):
    rule = asgd_jax.scale_by_staleness()
    g = jnp.array([1.0, -3.0])
    updates, _ = rule.update(g, rule.init(g), staleness=jnp.int32(tau))
    np.testing.assert_allclose(updates, g * factor, rtol=1e-7)


@pytest.mark.parametrize(("tau", "factor"), [(0, 1.0), (3, 1.0), (4, 1.0), (8, 0.5), (16, 0.25)])
def test_scale_by_delay_adaptive(tau, factor):
    rule = asgd_jax.scale_by_delay_adaptive(4)
    updates, _ = rule.update(jnp.ones(2), rule.init(None), staleness=jnp.int32(tau))
    np.testing.assert_allclose(updates, [factor, factor], rtol=1e-7)


@pytest.mark.parametrize(("tau", "kept"), [(0, True), (2, True), (3, False), (100, False)])
def test_drop_stale(tau, kept):
    rule = asgd_jax.drop_stale(2)
    updates, _ = rule.update(jnp.ones(2), rule.init(None), staleness=jnp.int32(tau))
    np.testing.assert_array_equal(updates, np.ones(2) if kept else np.zeros(2))


# --------------------------------------------------------------------------------------------------------------------
# Errors a user can cause.
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "name"),
    [
        (lambda: asgd_jax.dc_asgd(0.1, lam=-1.0), "lam"),
        (lambda: asgd_jax.dc_asgd(0.1, adaptive=True, mean_square_decay=1.0), "mean_square_decay"),
        (lambda: asgd_jax.dc_asgd(0.1, adaptive=True, mean_square_decay=-0.1), "mean_square_decay"),
        (lambda: asgd_jax.dc_asgd(0.1, eps=0.0), "eps"),
        (lambda: asgd_jax.dc_asgd(0.1, num_workers=0), "num_workers"),
        (lambda: asgd_jax.dc_asgd(0.1, num_workers=2.5), "num_workers"),
        (lambda: asgd_jax.dc_asgd(-0.1), "learning_rate"),
        (lambda: asgd_jax.asgd(0.1, momentum=1.5), "momentum"),
        (lambda: asgd_jax.delay_adaptive_sgd(0.1, num_workers=0), "num_workers"),
        (lambda: asgd_jax.drop_stale(-1), "max_staleness"),
    ],
)
def test_bad_hyperparameters_raise_naming_the_argument(build, name):
    with pytest.raises(ValueError, match=rf"^{name}="):
        build()


@pytest.mark.parametrize(
    ("rule", "missing"),
    [
        (asgd_jax.dc_asgd(0.1), "stale_params"),
        (asgd_jax.scale_by_delay_compensation(), "stale_params"),
        (asgd_jax.staleness_aware_sgd(0.1), "staleness"),
        (asgd_jax.delay_adaptive_sgd(0.1, 4), "staleness"),
        (asgd_jax.drop_stale(3), "staleness"),
    ],
)
def test_missing_extra_argument_raises_type_error_naming_it(rule, missing):
    with pytest.raises(TypeError, match=missing):
        rule.update(GRADS, rule.init(PARAMS), PARAMS)


def test_per_worker_mean_square_needs_worker():
    rule = asgd_jax.scale_by_delay_compensation(2.0, adaptive=True, num_workers=2)
    with pytest.raises(TypeError, match="worker"):
        rule.update(GRADS, rule.init(PARAMS), PARAMS, stale_params=STALE)
