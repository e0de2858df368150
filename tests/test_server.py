"""The parameter server as pure functions: DC-ASGD's Algorithm 2 against a float64 NumPy reference; backups are
snapshots."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from helpers.compiles import compilations
from helpers.reference import ReferenceServer, lsq_grad, run_trace

import asgd_jax
from asgd_jax import server


def _lsq_problem(num_workers, dim=5, n=8, num_batches=7, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(num_batches, n, dim))
    y = rng.normal(size=(num_batches, n))
    w0 = rng.normal(size=dim)
    order = rng.integers(0, num_workers, size=80)
    return a, y, w0, order


@pytest.mark.parametrize(
    ("lam", "adaptive", "per_worker"),
    [(None, False, False), (0.5, False, False), (2.0, True, False), (2.0, True, True)],
    ids=["asgd", "dc_asgd_c", "dc_asgd_a", "dc_asgd_a_per_worker"],
)
def test_server_with_rule_matches_numpy_reference(lam, adaptive, per_worker):
    num_workers, lr = 4, 0.05
    a, y, w0, order = _lsq_problem(num_workers)
    batch_for = lambda worker, t: (a[(worker + t) % len(a)], y[(worker + t) % len(y)])

    ref = ReferenceServer(w0, num_workers, lr, lam, adaptive, per_worker_ms=per_worker)
    want = run_trace(ref, order, batch_for)

    if lam is None:
        rule = asgd_jax.asgd(lr)
    else:
        rule = asgd_jax.dc_asgd(lr, lam, adaptive=adaptive, num_workers=num_workers if per_worker else None)
    state = server.init(rule, jnp.asarray(w0, jnp.float32), num_workers)
    staleness = []
    for t, worker in enumerate(order):
        stale, _ = server.snapshot(state, worker)
        ab, yb = batch_for(worker, t)
        g = jnp.asarray(lsq_grad(np.asarray(stale, np.float64), ab, yb), jnp.float32)
        state, tau = server.push(rule, state, worker, g)
        state = server.pull(state, worker)
        staleness.append(int(tau))
    assert staleness == ref.staleness
    assert max(staleness) >= 3  # the trace really is asynchronous
    np.testing.assert_allclose(np.asarray(state.params), want, rtol=2e-4, atol=2e-5)


def test_the_servers_functions_called_eagerly_compile_nothing_after_the_first_step():
    """A notebook steps the server by hand: a backup's read is the plain slice outside a program (inside one it is a
    conditional, for XLA's sake: server.row), so the second and later steps reuse the first's programs."""
    rule = asgd_jax.dc_asgd(0.05, 2.0, adaptive=True, num_workers=2)
    state = server.init(rule, jnp.zeros(3), 2)

    def step(state, worker):
        stale, _ = server.snapshot(state, worker)
        state, _ = server.push(rule, state, worker, stale + 1.0)
        return server.pull(state, worker)

    state = step(step(state, 0), 1)
    with compilations() as counts:
        for worker in (0, 1, 1, 0):
            state = step(state, worker)
    assert sum(counts.values()) == 0, counts
    assert int(state.version) == 6


def test_per_worker_and_global_mean_square_differ():
    # Pins that num_workers switches to the authors' per-worker MeanSquare (not a silent alias of the global one).
    a, y, w0, order = _lsq_problem(3)
    batch_for = lambda worker, t: (a[t % len(a)], y[t % len(y)])
    finals = [
        run_trace(ReferenceServer(w0, 3, 0.05, 2.0, True, per_worker_ms=pw), order, batch_for) for pw in (False, True)
    ]
    assert np.abs(finals[0] - finals[1]).max() > 1e-4


def test_server_backups_start_at_w0_and_are_snapshots():
    rule = asgd_jax.dc_asgd(0.5, 0.04)
    w0 = jnp.array([1.0, 2.0, 3.0])
    state = server.init(rule, w0, num_slots=2)
    np.testing.assert_array_equal(state.backup_params, np.stack([w0, w0]))  # w_0, not zeros
    state = server.pull(state, 0)
    pulled = np.asarray(server.snapshot(state, 0)[0]).copy()
    for _ in range(3):  # worker 1 keeps pushing; worker 0's backup must not follow the live weights
        state, _ = server.push(rule, state, 1, jnp.ones(3))
    np.testing.assert_array_equal(server.snapshot(state, 0)[0], pulled)
    assert not np.allclose(state.params, pulled)
    # Worker 0 now pushes with staleness 3 and a correction against its own snapshot.
    g = jnp.array([1.0, -1.0, 2.0])
    before = state.params
    state, tau = server.push(rule, state, 0, g)
    assert int(tau) == 3
    want = before - 0.5 * (g + 0.04 * g * g * (before - pulled))
    np.testing.assert_allclose(state.params, want, rtol=1e-6)
