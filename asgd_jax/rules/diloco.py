"""DiLoCo's outer optimizer: Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato, Szlam, Shen, "DiLoCo:
Distributed Low-Communication Training of Language Models", 2023 (a preprint); its asynchronous form as Liu et al.
2024 run it ("Asynchronous Local-SGD Training for Language Modeling").

:func:`diloco`: Nesterov SGD on the pushed pseudo-gradient. The family is this rule on workers that push a delta
after H local steps (``push="delta"``, ``n_sync=H``): synchronous DiLoCo in rounds (``mode="sync"``: the round's
mean delta, one outer step), asynchronous DiLoCo on every arrival (``mode="async"``), and Delayed Nesterov
(:func:`asgd_jax.rules.delayed_nesterov`) its asynchronous repair.
"""

from __future__ import annotations

import jax
import optax

from asgd_jax.recipes import recipe
from asgd_jax.rules.async_sgd import asgd
from asgd_jax.rules.common import ScalarOrSchedule


@recipe(elementwise=True)
def diloco(
    learning_rate: ScalarOrSchedule = 0.7, *, momentum: float | jax.Array = 0.9, nesterov: bool = True
) -> optax.GradientTransformationExtraArgs:
    r"""DiLoCo's outer step: Nesterov SGD on the pushed delta :math:`\Delta = w_{pulled} - w_{local}`.

    With :math:`\epsilon` the outer learning rate and :math:`\beta` the momentum (Algorithm 1's OuterOpt, optax's
    Nesterov form):

    .. math::
        m \leftarrow \beta m + \Delta,\quad w \leftarrow w - \epsilon (\beta m + \Delta)

    Synchronous DiLoCo (``Plan(M, mode="sync", push="delta", n_sync=H, local_lr=...)``) applies it once a round to
    the mean of the M deltas; with :math:`\epsilon = 1`, :math:`\beta = 0` that is local SGD's average of the workers'
    weights. Asynchronous DiLoCo (``mode="async"``) applies each delta on arrival, however stale: the baseline that
    Delayed Nesterov repairs. The defaults are the papers' (outer learning rate 0.7, momentum 0.9, Nesterov); Liu et
    al.'s asynchronous runs lower the outer rate (their toy: 0.07).

    Args:
      learning_rate: :math:`\epsilon` (a float or a schedule of outer steps).
      momentum: :math:`\beta` in [0, 1).
      nesterov: Nesterov (DiLoCo's) or heavy-ball momentum.

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> rule = asgd_jax.rules.diloco(1.0, momentum=0.0)   # the mean delta applied: local SGD's average
      >>> w = jnp.array([1.0, 2.0])
      >>> rule.update(jnp.array([0.5, -1.0]), rule.init(w), w, staleness=0)[0]
      Array([-0.5,  1. ], dtype=float32)

    References:
      Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", 2023 (arXiv 2311.08105);
      Liu et al., "Asynchronous Local-SGD Training for Language Modeling", 2024 (arXiv 2401.09135).
    """
    return asgd(learning_rate, momentum=momentum, nesterov=nesterov)  # (asgd's step, DiLoCo's defaults)
