r"""Ringleader ASGD: cycles of exactly n updates on two tables of per-worker mean gradients (Maranjyan & Richtárik
2026).

Maranjyan, Richtárik, "Ringleader ASGD: The First Asynchronous SGD with Optimal Time Complexity under Data
Heterogeneity", ICLR 2026, arXiv 2509.22860 (Algorithm 1; the authors' simulator, ``RingleaderASGD``, for the order of
events). Every worker computes at the weights it last received, and every arrival is a push. A cycle has two phases:

* **Phase 1**: arrivals are folded into the current table's running mean of their worker (no update) until every
  worker has a row there.
* **Phase 2**: exactly n updates :math:`x \leftarrow x - \gamma\,\frac1n\sum_i \bar g_i` (the mean over the current
  table's rows), the first at the arrival that ends phase 1, then one at the first arrival of each other worker (its
  gradient folded into its row first). An arrival from a worker that has already made its update this cycle goes into
  the *next* table (no update), which becomes the current one when the cycle's n-th update is made.

So every update averages all n workers (made for heterogeneous data), every worker's data weighs the same however fast
it is, and the delay of any gradient in an update is at most 2n - 2. With one worker it is SGD.

Both tables live in one ``[2n, ...]`` table (row ``j * n + i``: table j's row of worker i), each row stamped with the
cycle it belongs to, so the swap of tables is a flip of the cycle's parity: O(d) per arrival, whatever n.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from asgd_jax.recipes import recipe
from asgd_jax.rules import common
from asgd_jax.rules.common import MeanTable, ScalarOrSchedule

__all__ = ["RingleaderState", "ringleader_asgd", "scale_by_ringleader"]


class RingleaderState(NamedTuple):
    """The two tables (rows ``j * n + i``), each table's mean over workers (leaves ``[2, *leaf]``), each table's
    workers with a row (int32 ``[2]``), the workers still to update in phase 2 (bool ``[n]``), the updates left in
    phase 2 (0: phase 1) and the cycle (its parity: the current table)."""

    table: MeanTable
    means: optax.Updates
    arrived: jax.Array
    needs: jax.Array
    remaining: jax.Array
    cycle: jax.Array


def scale_by_ringleader(num_workers: int) -> optax.GradientTransformationExtraArgs:
    """Ringleader ASGD's step: the current table's mean over workers at each of a cycle's n updates, zero at every
    other arrival.

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> t = asgd_jax.rules.scale_by_ringleader(2)
      >>> s = t.init(jnp.zeros(1))
      >>> u, s = t.update(jnp.array([4.0]), s, worker=0)   # phase 1: worker 1 has not reported
      >>> u, s = t.update(jnp.array([2.0]), s, worker=1)   # phase 1 ends: update 1 of 2, (4 + 2) / 2
      >>> u
      Array([3.], dtype=float32)
      >>> u, s = t.update(jnp.array([6.0]), s, worker=1)   # worker 1 has updated: into the next table
      >>> u
      Array([0.], dtype=float32)
      >>> t.update(jnp.array([8.0]), s, worker=0)[0]       # update 2 of 2: worker 0's mean (4 + 8) / 2, and 2
      Array([4.], dtype=float32)
    """
    common.check_num_workers("num_workers", num_workers, static=True)
    n = num_workers

    def init(params):
        zero = jnp.zeros((), jnp.int32)
        means = jax.tree.map(lambda p: jnp.zeros((2, *jnp.shape(p)), jnp.result_type(p)), params)
        table = common.mean_table(params, 2 * n)
        return RingleaderState(table, means, jnp.zeros((2,), jnp.int32), jnp.zeros((n,), bool), zero, zero)

    def update(updates, state, params=None, *, worker, **extra):
        del params, extra
        w = jnp.asarray(worker, jnp.int32)
        current, phase2 = state.cycle % 2, state.remaining > 0
        to_next = phase2 & ~state.needs[w]  # already updated this cycle: the next table
        target = jnp.where(to_next, 1 - current, current)
        table, change, first = common.fold_mean(state.table, target * n + w, state.cycle + to_next, updates)
        means = jax.tree.map(lambda m, c: m.at[target].add(c / n), state.means, change)
        arrived = state.arrived.at[target].add(first.astype(jnp.int32))
        begins = ~phase2 & (arrived[current] == n)  # phase 1 ends: the cycle's first update
        steps = begins | (phase2 & state.needs[w])
        step = jax.tree.map(lambda m: jnp.where(steps, m[current], jnp.zeros_like(m[current])), means)
        others = jnp.arange(n, dtype=jnp.int32) != w
        needs = jnp.where(begins, others, state.needs & (others | ~phase2))
        remaining = jnp.where(begins, n - 1, state.remaining - (phase2 & state.needs[w]).astype(jnp.int32))
        ends = steps & (remaining == 0)  # the cycle's n-th update: the next table becomes the current one
        means = jax.tree.map(lambda m: m.at[current].set(jnp.where(ends, jnp.zeros_like(m[0]), m[current])), means)
        arrived = arrived.at[current].set(jnp.where(ends, 0, arrived[current]))
        return step, RingleaderState(table, means, arrived, needs, remaining, state.cycle + ends)

    return optax.GradientTransformationExtraArgs(init, update)


@recipe
def ringleader_asgd(learning_rate: ScalarOrSchedule, *, num_workers: int) -> optax.GradientTransformationExtraArgs:
    """Ringleader ASGD: SGD on the mean of every worker's mean gradient, n updates a cycle (see the module).

    Args:
      learning_rate: the step (a float or an optax schedule over server updates: every arrival counts). The paper's
        theory: gamma = min{1 / (8 n L), eps B / (10 L sigma^2)}; its experiments tune it.
      num_workers: n (static: it shapes the tables).

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> rule = asgd_jax.rules.ringleader_asgd(0.5, num_workers=1)  # one worker: SGD
      >>> w = jnp.array([1.0])
      >>> rule.update(jnp.array([2.0]), rule.init(w), w, worker=0)[0]
      Array([-1.], dtype=float32)
    """
    return optax.chain(scale_by_ringleader(num_workers), common.sgd(learning_rate, None, False))
