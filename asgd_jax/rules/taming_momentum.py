"""DANA: Hakimi, Barkai, Gabel, Schuster, "Taming Momentum in a Distributed Asynchronous Environment", 2019 (a
preprint).

:func:`dana`, a :class:`asgd_jax.rules.PullRule`: momentum per worker, and every worker pulls a look-ahead of where the
weights will be (DANA-Zero; DANA-DC with ``lam``); :class:`DanaState` is its state.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from asgd_jax import server
from asgd_jax.recipes import recipe
from asgd_jax.rules import common
from asgd_jax.rules.common import PullRule, ScalarOrSchedule


class DanaState(NamedTuple):
    """State of :func:`dana`: the update count, every worker's momentum ``v`` (a leading axis of ``num_workers``)
    and their sum ``S``."""

    count: jax.Array
    velocity: optax.Updates
    velocity_sum: optax.Updates


@recipe(elementwise=True)
def dana(
    learning_rate: ScalarOrSchedule,
    *,
    num_workers: int,
    momentum: float | jax.Array = 0.9,
    lam: float | jax.Array = 0.0,
) -> PullRule:
    r"""DANA: momentum per worker, and every worker pulls a look-ahead of where the weights will be.

    Push of :math:`g` by worker i (computed at the weights :math:`\hat w_i` it was sent; DANA-DC first compensates it
    against them, :math:`g \leftarrow g + \lambda\, g \odot g \odot (w - \hat w_i)`):

    .. math::
        v_i \leftarrow \gamma v_i + g, \quad w \leftarrow w - \eta\, v_i, \quad S \leftarrow S + v_i^{new} - v_i^{old}

    Pull by worker i: :math:`\hat w_i = w - \eta \gamma S` with :math:`S = \sum_j v_j`, the step every worker's
    momentum will still take before this worker's gradient lands (NAG's look-ahead, for all workers at once).

    Args:
      learning_rate: :math:`\eta` (a float or a schedule; the look-ahead uses the current one).
      num_workers: M (static: it shapes the per-worker momenta).
      momentum: :math:`\gamma` in [0, 1) (the paper: 0.9).
      lam: DANA-DC's :math:`\lambda` >= 0 (0: DANA-Zero; the authors' simulator uses 2 for DANA-DC).

    Returns:
      A :class:`PullRule` whose ``update`` requires ``worker`` (and ``stale_params`` with ``lam``).

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> rule = asgd_jax.rules.dana(0.1, num_workers=2, momentum=0.5)
      >>> w, state = jnp.ones(1), rule.init(jnp.ones(1))
      >>> u, state = rule.update(jnp.array([2.0]), state, w, worker=0, stale_params=w)
      >>> u, rule.pull(w + u, state, 1)   # v_0 = 2: w - 0.2; the look-ahead: w - 0.1 * 0.5 * (2 + 0)
      (Array([-0.2], dtype=float32), Array([0.7], dtype=float32))

    References:
      Hakimi, Barkai, Gabel, Schuster, "Taming Momentum in a Distributed Asynchronous Environment", 2019 (DANA-Zero;
      DANA-DC as in the authors' simulator: a constant lambda, against the look-ahead the worker used).
    """
    common.check_num_workers("num_workers", num_workers, static=True)
    common.check_decay("momentum", momentum)
    common.check_nonnegative("lam", lam)
    common.check_learning_rate(learning_rate)

    def init_fn(params):
        stack = jax.tree.map(lambda p: jnp.zeros((num_workers, *jnp.shape(p)), jnp.result_type(p)), params)
        return DanaState(jnp.zeros((), jnp.int32), stack, jax.tree.map(jnp.zeros_like, params))

    def update_fn(updates, state, params=None, *, worker, stale_params=None, **extra_args):
        del extra_args
        if stale_params is not None:  # DANA-DC (lam = 0 leaves the gradient as it is)
            updates = jax.tree.map(
                lambda g, w, wb: (g + lam * g * g * (w - wb)).astype(g.dtype), updates, params, stale_params
            )
        old = server.row(state.velocity, worker)  # (read once: S's update reads it too, not only the write)
        new = jax.tree.map(lambda v, g: momentum * v + g, old, updates)
        velocity = server.replace_row(state.velocity, worker, new, old)
        velocity_sum = jax.tree.map(lambda s, n, o: s + n - o, state.velocity_sum, new, old)
        rate = common.rate(learning_rate, state.count)
        steps = jax.tree.map(lambda v, g: (-rate * v).astype(g.dtype), new, updates)
        return steps, DanaState(optax.safe_increment(state.count), velocity, velocity_sum)

    def pull_fn(params, state, worker):
        del worker  # every worker gets the same look-ahead (DANA-Zero's S sums all momenta)
        lead = common.rate(learning_rate, state.count) * momentum
        return jax.tree.map(lambda w, s: (w - lead * s).astype(w.dtype), params, state.velocity_sum)

    return PullRule(init_fn, update_fn, pull_fn)
