r"""Malenia SGD: the mean over workers of each worker's mean gradient of the round (Tyurin & Richtárik 2023).

Tyurin, Richtárik, "Optimal Time Complexities of Parallel Stochastic Optimization Methods Under a Fixed Computation
Model", NeurIPS 2023, arXiv 2305.12387, Algorithm 5 (Malenia SGD, for heterogeneous data: worker i samples only from
its own distribution). In round k every worker computes gradients at x^k, one after another, until every worker has
given at least one; with :math:`b_i` of them from worker i,

.. math::
    x^{k+1} = x^k - \gamma\, \frac1n \sum_{i=1}^n \frac{1}{b_i} \sum_{j=1}^{b_i} g_{ij},

so a fast worker's data weighs as much as a slow one's, however many gradients it gave. (The paper's round also waits
until :math:`(\frac1n\sum_i 1/b_i)^{-1} \ge S/n`; the KAUST group's simulator, whose experiments the 2024-2026 papers
report, closes the round at the first arrival that completes every worker: so does this rule, S = n.)

The rule keeps each worker's running mean of the round (an n-row table, one row read and written per arrival, a new
round clearing it in O(1)) and steps at the round's last arrival, a zero step at every other. Run it on the cluster
that closes rounds the same way, :class:`asgd_jax.delays.Malenia`, which stops every other computation at the close
(on another cluster a gradient begun at x^k and arriving in round k + 1 is counted there).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from asgd_jax.recipes import recipe
from asgd_jax.rules import common
from asgd_jax.rules.common import MeanTable, ScalarOrSchedule

__all__ = ["MaleniaState", "malenia_sgd", "scale_by_malenia"]


class MaleniaState(NamedTuple):
    """The round's per-worker running means, their mean over workers, how many workers have reported, the round."""

    table: MeanTable
    mean: optax.Updates
    arrived: jax.Array
    round: jax.Array


def scale_by_malenia(num_workers: int) -> optax.GradientTransformationExtraArgs:
    """The mean over the ``num_workers`` workers of each one's mean gradient of the round, at the arrival that
    completes the round (every worker reported); zero at every other arrival.

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> t = asgd_jax.rules.scale_by_malenia(2)
      >>> s = t.init(jnp.zeros(1))
      >>> _, s = t.update(jnp.array([4.0]), s, worker=0)
      >>> _, s = t.update(jnp.array([2.0]), s, worker=0)  # worker 0's mean: 3
      >>> t.update(jnp.array([9.0]), s, worker=1)[0]      # (3 + 9) / 2
      Array([6.], dtype=float32)
    """
    common.check_num_workers("num_workers", num_workers, static=True)
    n = num_workers

    def init(params):
        zero = jnp.zeros((), jnp.int32)
        return MaleniaState(common.mean_table(params, n), jax.tree.map(jnp.zeros_like, params), zero, zero)

    def update(updates, state, params=None, *, worker, **extra):
        del params, extra
        table, change, first = common.fold_mean(state.table, jnp.asarray(worker, jnp.int32), state.round, updates)
        mean = jax.tree.map(lambda m, c: m + c / n, state.mean, change)
        arrived = state.arrived + first.astype(jnp.int32)
        closes = arrived == n
        step = jax.tree.map(lambda m: jnp.where(closes, m, jnp.zeros_like(m)), mean)
        cleared = jax.tree.map(lambda m: jnp.where(closes, jnp.zeros_like(m), m), mean)
        return step, MaleniaState(table, cleared, jnp.where(closes, 0, arrived), state.round + closes)

    return optax.GradientTransformationExtraArgs(init, update)


@recipe
def malenia_sgd(learning_rate: ScalarOrSchedule, *, num_workers: int) -> optax.GradientTransformationExtraArgs:
    """Malenia SGD: SGD on the mean over workers of each worker's mean gradient of the round (on
    :class:`asgd_jax.delays.Malenia`).

    Args:
      learning_rate: the step (a float or an optax schedule over server updates: every arrival counts).
      num_workers: n (static: it shapes the table).

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> rule = asgd_jax.rules.malenia_sgd(0.5, num_workers=1)  # one worker: SGD
      >>> w = jnp.array([1.0])
      >>> rule.update(jnp.array([2.0]), rule.init(w), w, worker=0)[0]
      Array([-1.], dtype=float32)
    """
    return optax.chain(scale_by_malenia(num_workers), common.sgd(learning_rate, None, False))
