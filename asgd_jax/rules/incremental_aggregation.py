r"""IA²SGD: incremental aggregation of every worker's latest gradient (Wang, Sun, Wai, Zhang 2024).

Wang, Sun, Wai, Zhang, "Dual-Delayed Asynchronous SGD for Arbitrarily Heterogeneous Data" (DuDe-ASGD; the
incrementally aggregated form, IA²SGD), arXiv 2405.16966, 2024. The server keeps a table G of each worker's latest
gradient. Until every worker has reported once it only fills the table (the weights stay where they are: every worker
computes its first gradient at x⁰); from then on, on each arrival from worker i:

.. math::
    G_i \leftarrow g, \qquad x \leftarrow x - \gamma\, \frac1n \sum_j G_j,

the mean kept incrementally, :math:`m \leftarrow m + (g - G_i^{old}) / n` (O(d) per update, not O(n·d)), and worker i
restarts at the new x. Made for heterogeneous data: every step averages all n workers' (possibly stale) gradients, so
no worker's data is over-weighted by its speed. With one worker it is SGD.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from asgd_jax import server
from asgd_jax.recipes import recipe
from asgd_jax.rules import common
from asgd_jax.rules.common import ScalarOrSchedule

__all__ = ["IncrementalAggregationState", "ia2sgd", "scale_by_incremental_aggregation"]


class IncrementalAggregationState(NamedTuple):
    """The table of latest gradients (leaves ``[n, *leaf]``), their mean, and who has reported (bool ``[n]``)."""

    table: optax.Updates
    mean: optax.Updates
    seen: jax.Array


def scale_by_incremental_aggregation(num_workers: int) -> optax.GradientTransformationExtraArgs:
    r"""The mean of every worker's latest gradient, once all ``num_workers`` have reported (zero before).

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` whose ``update`` requires ``worker``.

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> t = asgd_jax.rules.scale_by_incremental_aggregation(2)
      >>> s = t.init(jnp.zeros(1))
      >>> u, s = t.update(jnp.array([4.0]), s, worker=0)  # warm-up: worker 1 has not reported
      >>> u
      Array([0.], dtype=float32)
      >>> t.update(jnp.array([2.0]), s, worker=1)[0]      # (4 + 2) / 2
      Array([3.], dtype=float32)
    """
    common.check_num_workers("num_workers", num_workers, static=True)

    def init(params):
        return IncrementalAggregationState(
            jax.tree.map(lambda p: jnp.zeros((num_workers, *jnp.shape(p)), jnp.result_type(p)), params),
            jax.tree.map(jnp.zeros_like, params),
            jnp.zeros((num_workers,), bool),
        )

    def update(updates, state, params=None, *, worker, **extra):
        del params, extra
        w = jnp.asarray(worker, jnp.int32)
        old = server.row(state.table, w)
        mean = jax.tree.map(lambda m, g, o: m + (g - o) / num_workers, state.mean, updates, old)
        table = server.replace_row(state.table, w, updates, old)
        seen = state.seen.at[w].set(True)
        ready = jnp.all(seen)
        step = jax.tree.map(lambda m: jnp.where(ready, m, jnp.zeros_like(m)), mean)
        return step, IncrementalAggregationState(table, mean, seen)

    return optax.GradientTransformationExtraArgs(init, update)


@recipe
def ia2sgd(learning_rate: ScalarOrSchedule, *, num_workers: int) -> optax.GradientTransformationExtraArgs:
    """IA²SGD: SGD on the mean of every worker's latest gradient, after a warm-up in which each reports once.

    Args:
      learning_rate: the step (a float or an optax schedule over server updates; the warm-up's pushes count).
      num_workers: n (static: it shapes the table).

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> rule = asgd_jax.rules.ia2sgd(0.5, num_workers=1)  # one worker: SGD
      >>> w = jnp.array([1.0])
      >>> rule.update(jnp.array([2.0]), rule.init(w), w, worker=0)[0]
      Array([-1.], dtype=float32)
    """
    return optax.chain(scale_by_incremental_aggregation(num_workers), common.sgd(learning_rate, None, False))
