"""The payload's compressors against their definitions: RandK and QSGD unbiased with the variance their papers state,
TopK the K largest and contractive, error feedback losing nothing; bad arguments refused; in a run, the same bits for
the same seed and one program for every seed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.compiles import compilations
from hypothesis import given, settings
from hypothesis import strategies as st

import asgd_jax
from asgd_jax import delays, rules
from asgd_jax.errors import ConfigError

G = {"a": jnp.array([0.5, -2.0, 1.5, 0.25]), "b": jnp.array([[3.0, -1.0], [0.75, -0.5]])}  # d = 8
FLAT = np.concatenate([np.ravel(G["a"]), np.ravel(G["b"])])


def _draws(compressor, n: int) -> np.ndarray:
    """``n`` compressions of ``G`` (the state's key split each time), flattened: ``[n, 8]``."""

    def one(state, _):
        out, state = compressor.update(G, state)
        return state, jnp.concatenate([jnp.ravel(out["a"]), jnp.ravel(out["b"])])

    return np.asarray(jax.lax.scan(one, compressor.init(G), None, length=n)[1])


@pytest.mark.parametrize("k", [1, 3, 8])
def test_rand_k_sends_k_coordinates_scaled_by_d_over_k_and_is_unbiased_with_omega_d_over_k_minus_1(k):
    draws = _draws(rules.rand_k(k, seed=7), 4000)
    assert ((draws != 0).sum(axis=1) == k).all()
    kept = draws != 0
    np.testing.assert_allclose(draws[kept], (np.broadcast_to(FLAT, draws.shape) * 8 / k)[kept], rtol=1e-6)
    # E C(x) = x: each coordinate is x_i d/k with probability k/d; the mean of 4000 within 5 standard errors.
    se = np.abs(FLAT) * np.sqrt(8 / k - 1) / np.sqrt(4000)
    assert (np.abs(draws.mean(axis=0) - FLAT) <= 5 * se + 1e-6).all()
    # E||C(x) - x||^2 = (d/k - 1)||x||^2.
    np.testing.assert_allclose(((draws - FLAT) ** 2).sum(axis=1).mean(), (8 / k - 1) * (FLAT**2).sum(), rtol=0.1)


@given(x=st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=1, max_size=12), data=st.data())
@settings(max_examples=40, deadline=None)
def test_top_k_keeps_the_k_largest_magnitudes_and_is_contractive(x, data):
    x = np.asarray(x, np.float32)
    k = data.draw(st.integers(1, x.size))
    c = rules.top_k(k)
    out = np.asarray(c.update(jnp.asarray(x), c.init(jnp.asarray(x)))[0])
    kept = out != 0
    assert kept.sum() <= k and (out[kept] == x[kept]).all()
    if kept.sum() < k:  # fewer only where x itself has zeros
        assert (x == 0).sum() >= k - kept.sum()
    assert np.abs(x[~kept]).max(initial=0) <= np.abs(x[kept]).min(initial=np.inf)
    assert ((out - x) ** 2).sum() <= (1 - k / x.size) * (x**2).sum() * (1 + 1e-6) + 1e-30


def test_top_k_error_feedback_sends_everything_a_worker_pushed_in_the_end():
    # e_w <- g + e_w - C(g + e_w): per worker, what was sent plus what is left equals what was pushed, exactly in
    # exact arithmetic (here to float32 rounding); the other worker's residual is untouched.
    c = rules.top_k(2, num_workers=2)
    rng = np.random.default_rng(0)
    state, sent, pushed = c.init(G), 0.0, 0.0
    for _ in range(6):
        g = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), G)
        out, state = c.update(g, state, worker=1)
        sent = jax.tree.map(lambda a, b: a + b, sent, out) if not isinstance(sent, float) else out
        pushed = jax.tree.map(lambda a, b: a + b, pushed, g) if not isinstance(pushed, float) else g
    for s, p, e in zip(jax.tree.leaves(sent), jax.tree.leaves(pushed), jax.tree.leaves(state.error), strict=True):
        np.testing.assert_allclose(s + e[1], p, rtol=1e-5, atol=1e-5)
        assert not np.asarray(e[0]).any()
    with pytest.raises(ConfigError, match="worker="):
        c.update(G, state)


@pytest.mark.parametrize("levels", [1, 4])
def test_qsgd_rounds_to_its_levels_of_the_norm_unbiased_within_its_variance_bound(levels):
    draws = _draws(rules.qsgd(levels, seed=3), 4000)
    norm = np.linalg.norm(FLAT)
    grid = np.abs(draws) * levels / norm
    np.testing.assert_allclose(grid, np.round(grid), atol=1e-4)  # every value a level: ||x|| l / s
    assert (np.sign(draws[draws != 0]) == np.sign(np.broadcast_to(FLAT, draws.shape)[draws != 0])).all()
    se = norm / levels / np.sqrt(4000)  # each coordinate's spread is at most one level
    assert (np.abs(draws.mean(axis=0) - FLAT) <= 5 * se).all()
    # Alistarh et al., Lemma 3.1: E||Q(x) - x||^2 <= min(d/s^2, sqrt(d)/s) ||x||^2.
    bound = min(8 / levels**2, np.sqrt(8) / levels) * norm**2
    assert ((draws - FLAT) ** 2).sum(axis=1).mean() <= bound


def test_a_zero_payload_compresses_to_zero():
    zero = jax.tree.map(jnp.zeros_like, G)
    for c in (rules.rand_k(3), rules.top_k(3), rules.qsgd(2)):
        out, _ = c.update(zero, c.init(G))
        assert all(not np.asarray(x).any() for x in jax.tree.leaves(out))


@given(
    k=st.one_of(st.integers(-3, 12), st.floats(0.5, 4), st.booleans(), st.none(), st.text(max_size=2)),
    seed=st.one_of(st.integers(-2, 3), st.floats(0, 2), st.none()),
)
@settings(max_examples=60, deadline=None)
def test_bad_counts_and_seeds_are_refused_with_the_name_and_the_fix(k, seed):
    count = isinstance(k, int) and not isinstance(k, bool) and k >= 1
    good_k = count and k <= 8  # (K of the 8 coordinates; QSGD's levels have no upper bound)
    good_seed = isinstance(seed, int) and seed >= 0
    for good, make in (
        (good_k, lambda: rules.rand_k(k, seed=seed).init(G)),
        (count, lambda: rules.qsgd(k, seed=seed).init(G)),
    ):
        if good and good_seed:
            make()
            continue
        with pytest.raises(ConfigError, match="is invalid"):
            make()
    if good_k:
        rules.top_k(k).init(G)
    else:
        with pytest.raises(ConfigError, match="k="):
            rules.top_k(k).init(G)


def test_a_compressed_run_is_the_same_bits_for_its_seed_and_one_program_for_every_seed():
    x = np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32)
    data = {"x": x, "y": x @ np.arange(1.0, 9.0, dtype=np.float32)}
    loss = lambda w, b: 0.5 * jnp.mean((b["x"] @ w - b["y"]) ** 2)
    plan = asgd_jax.Plan(delays.Workers(3), batch_size=4, num_updates=60, chunk=30)

    def run(seed):
        rule = rules.compressed(asgd_jax.asgd(0.05), rules.rand_k(2, seed=seed))
        return np.asarray(asgd_jax.simulate(loss, rule, np.zeros(8, np.float32), data, plan, progress=False).params)

    first = run(0)
    with compilations() as compiled:
        again, other = run(0), run(1)
    assert sum(v for k, v in compiled.items() if k.startswith("simulator")) == 0, compiled
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    plain = asgd_jax.simulate(loss, asgd_jax.asgd(0.05), np.zeros(8, np.float32), data, plan, progress=False)
    assert np.abs(first - np.arange(1.0, 9.0)).sum() < np.abs(np.arange(1.0, 9.0)).sum()  # it still descends
    assert not np.array_equal(first, np.asarray(plain.params))


def test_a_fraction_of_the_payload_is_a_count_fixed_by_its_shape():
    g = jnp.array([0.1, -4.0, 0.3, 2.0, -0.2, 0.0, 5.0, 1.0])
    top = rules.top_k(fraction=0.25)
    np.testing.assert_array_equal(top.update(g, top.init(g))[0], [0, -4.0, 0, 0, 0, 0, 5.0, 0])
    rand = rules.rand_k(fraction=0.5, seed=3)
    out = np.asarray(rand.update(g, rand.init(g))[0])
    kept = np.flatnonzero(out)
    assert len(kept) <= 4 and np.allclose(out[kept], 2.0 * np.asarray(g)[kept])  # d / k = 2, unbiased
    assert rules.top_k(fraction=1e-9).update(g, top.init(g))[0].tolist().count(0.0) == 7  # at least one kept
    for bad in ({"k": 2, "fraction": 0.5}, {}, {"fraction": 0.0}, {"fraction": 1.5}, {"fraction": True}):
        with pytest.raises(ConfigError, match=r"k|fraction"):
            rules.top_k(**bad)
        with pytest.raises(ConfigError, match=r"k|fraction"):
            rules.rand_k(**bad)
