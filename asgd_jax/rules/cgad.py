"""CGAD: Shah, Sun, "Cosine-Gated Adam-Decay: Drop-In Staleness-Aware Outer Optimization for Decoupled DiLoCo",
2026 (a preprint).

:func:`scale_by_age` scales a push by its age, :math:`\\gamma(\\tau) e^{-\\alpha\\tau}`; :func:`cgad` chains it with
Adam (the scaled push enters both of Adam's moments).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from asgd_jax.recipes import recipe
from asgd_jax.rules import common
from asgd_jax.rules.common import ScalarOrSchedule


def _age_factor(staleness: jax.Array, decay: float | jax.Array, cutoff: float | jax.Array | None) -> jax.Array:
    r""":math:`\sigma(\tau) = \gamma(\tau) e^{-\alpha\tau}` with the cosine gate
    :math:`\gamma(\tau) = \tfrac12 (1 + \cos(\pi\tau/\tau_{cut}))` below the cutoff and 0 from it on (``cutoff=None``:
    :math:`\gamma = 1`, Adam-Decay)."""
    tau = jnp.asarray(staleness, jnp.float32)
    factor = jnp.exp(-jnp.asarray(decay, jnp.float32) * tau)
    if cutoff is None:
        return factor
    cut = jnp.asarray(cutoff, jnp.float32)
    return jnp.where(tau < cut, 0.5 * (1.0 + jnp.cos(jnp.pi * jnp.minimum(tau / cut, 1.0))) * factor, 0.0)


@recipe(numbers=("decay", "cutoff"))
def scale_by_age(
    decay: float | jax.Array = 0.1, cutoff: float | jax.Array | None = 16
) -> optax.GradientTransformationExtraArgs:
    r"""Scales a push by its age :math:`\tau` (its staleness): :math:`\sigma(\tau) = \gamma(\tau) e^{-\alpha\tau}`,
    :math:`\gamma` a cosine gate that reaches 0 at the cutoff (its docstring above); :math:`\sigma(0) = 1`.

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> rule = asgd_jax.rules.scale_by_age(decay=0.0, cutoff=4)
      >>> [round(float(rule.update(jnp.ones(1), rule.init(None), staleness=t)[0][0]), 6) for t in (0, 2, 4)]
      [1.0, 0.5, 0.0]
    """
    common.check_nonnegative("decay", decay)
    if cutoff is not None:
        common.check_positive("cutoff", cutoff)
    return common.scale_by(lambda tau: _age_factor(tau, decay, cutoff))


@recipe(numbers=("learning_rate", "decay", "cutoff"))
def cgad(
    learning_rate: ScalarOrSchedule,
    *,
    decay: float | jax.Array = 0.1,
    cutoff: float | jax.Array | None = 16,
    b1: float | jax.Array = 0.9,
    b2: float | jax.Array = 0.999,
    eps: float | jax.Array = 1e-8,
) -> optax.GradientTransformationExtraArgs:
    r"""CGAD: Adam on each push scaled by its age, :math:`\sigma(\tau) = \gamma(\tau) e^{-\alpha\tau}`, before it
    enters the moments; plain Adam at :math:`\tau = 0`.

    For asynchronous DiLoCo (``push="delta"``, ``n_sync`` = H, each delta applied on arrival), :math:`\tau` is the
    push's staleness in server (outer) steps. A push past the cutoff adds nothing to the moments, but the step still
    follows them (Adam's momentum decays). ``cutoff=None`` is Adam-Decay, the paper's closest baseline.

    What the preprint's abstract fixes: the scaling :math:`\gamma(\tau) e^{-\alpha\tau}` of the push before both of
    Adam's moments, the gate zeroing contributions smoothly past a cutoff, Adam at :math:`\tau = 0`. Not recoverable
    here (the paper's method section was not available): the gate's exact form (this is the raised cosine
    :math:`\tfrac12(1 + \cos(\pi\tau/\tau_{cut}))` below the cutoff, 0 from it), and the defaults of :math:`\alpha`
    and :math:`\tau_{cut}` (0.1 and 16 here, a push of age 8 keeps 0.22 of its weight); Adam's
    bias correction and constants are optax's.

    Args:
      learning_rate: the outer learning rate (a float or a schedule of server steps).
      decay: :math:`\alpha` >= 0 (0: the gate alone).
      cutoff: :math:`\tau_{cut}` > 0, the age from which a push counts nothing; ``None``: no gate (Adam-Decay).
      b1, b2, eps: Adam's.

    Example:
      >>> import jax.numpy as jnp, optax, asgd_jax
      >>> rule, adam = asgd_jax.rules.cgad(0.1), optax.adam(0.1)
      >>> g, w = jnp.array([2.0]), jnp.zeros(1)
      >>> bool(rule.update(g, rule.init(w), w, staleness=0)[0] == adam.update(g, adam.init(w), w)[0])
      True

    References:
      Shah, Sun, "Cosine-Gated Adam-Decay: Drop-In Staleness-Aware Outer Optimization for Decoupled DiLoCo", arXiv
      2605.09126, 2026 (the abstract's definition of sigma).
    """
    common.check_decay("b1", b1)
    common.check_decay("b2", b2)
    common.check_nonnegative("eps", eps)
    common.check_learning_rate(learning_rate)
    return optax.chain(
        scale_by_age(decay, cutoff),
        optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
        optax.scale_by_learning_rate(learning_rate),
    )
