"""DC-ASGD: Zheng et al., "Asynchronous Stochastic Gradient Descent with Delay Compensation", ICML 2017.

:func:`scale_by_delay_compensation` (the Taylor term, DC-ASGD-c with a constant lambda or DC-ASGD-a with the adaptive
one, its ``MeanSquare`` global or per worker) with its state :class:`ScaleByDelayCompensationState`, and
:func:`dc_asgd`, the compensation chained with SGD.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from asgd_jax.recipes import recipe
from asgd_jax.rules import common
from asgd_jax.rules.common import ScalarOrSchedule


class ScaleByDelayCompensationState(NamedTuple):
    """State of :func:`scale_by_delay_compensation`.

    Attributes:
      mean_square: DC-ASGD-a's ``MeanSquare`` accumulator, a tree like the params (global, as in the paper) or with a
        leading axis of size ``num_workers`` (one per worker, as in the authors' server code). ``None`` for DC-ASGD-c,
        which keeps no state.
    """

    mean_square: optax.Updates | None


@recipe(elementwise=True)
def scale_by_delay_compensation(
    lam: float | jax.Array = 0.04,
    *,
    adaptive: bool | jax.Array = False,
    mean_square_decay: float | jax.Array = 0.95,
    eps: float | jax.Array = 1e-7,
    num_workers: int | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Compensates a stale gradient with DC-ASGD's cheap Taylor term.

    .. math::
        \tilde g = g + \lambda_t \, g \odot g \odot (w_t - w_{bak}(m))

    (Zheng et al. 2017, Eq. 10, without the learning rate). DC-ASGD-c uses :math:`\lambda_t = \lambda_0`;
    DC-ASGD-a (``adaptive=True``) first updates :math:`MS \leftarrow m\,MS + (1 - m)\,g \odot g` with the incoming
    gradient and then uses :math:`\lambda_t = \lambda_0 / \sqrt{MS + \epsilon}` elementwise. With ``lam = 0`` or
    ``stale_params == params`` the gradient passes through unchanged.

    Args:
      lam: :math:`\lambda_0 \ge 0`; the paper uses 0.04 for DC-ASGD-c and 2 for DC-ASGD-a on CIFAR-10.
      adaptive: ``True`` for DC-ASGD-a. May also be a (traced) boolean array, so that DC-ASGD-c and -a runs share
        one compiled program in a :func:`asgd_jax.sweep`; ``MeanSquare`` is then always kept.
      mean_square_decay: the momentum ``m`` of ``MeanSquare``, in [0, 1) (paper: 0.95).
      eps: :math:`\epsilon > 0` inside the square root (paper: 1e-7).
      num_workers: ``None`` keeps one global ``MeanSquare`` (the paper); an int keeps one per worker, indexed by the
        ``worker`` extra argument and updated only with that worker's gradients (the authors' server code).

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` whose ``update`` requires ``stale_params`` (and ``worker`` when
      ``num_workers`` is given).

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> rule = asgd_jax.scale_by_delay_compensation(lam=0.5)
      >>> w_t, w_bak, g = jnp.array([1.0, 2.0]), jnp.array([0.0, 2.0]), jnp.array([2.0, 3.0])
      >>> updates, _ = rule.update(g, rule.init(w_t), w_t, stale_params=w_bak)
      >>> updates  # [2 + 0.5 * 4 * 1, 3 + 0]
      Array([4., 3.], dtype=float32)

    References:
      Zheng et al., "Asynchronous Stochastic Gradient Descent with Delay Compensation", ICML 2017, Eq. 10 and
      Algorithm 2.
    """
    common.check_nonnegative("lam", lam)
    common.check_decay("mean_square_decay", mean_square_decay)
    common.check_positive("eps", eps)
    if num_workers is not None:
        common.check_num_workers("num_workers", num_workers, static=True)
    # A Python bool decides the structure; an array decides per run, inside the program.
    keeps_mean_square = not isinstance(adaptive, bool) or adaptive
    per_worker = keeps_mean_square and num_workers is not None

    def init_fn(params):
        if not keeps_mean_square:
            return ScaleByDelayCompensationState(mean_square=None)
        if per_worker:
            zeros = lambda p: jnp.zeros((num_workers, *jnp.shape(p)), jnp.result_type(p))
        else:
            zeros = lambda p: jnp.zeros(jnp.shape(p), jnp.result_type(p))
        return ScaleByDelayCompensationState(mean_square=jax.tree.map(zeros, params))

    def update_fn(updates, state, params=None, *, stale_params, worker=None, **extra_args):
        del extra_args
        if params is None:
            raise ValueError(
                "scale_by_delay_compensation needs the server's current weights: call "
                "update(grads, state, params, stale_params=...)."
            )
        if per_worker and worker is None:
            raise TypeError(
                "scale_by_delay_compensation(num_workers=...) keeps MeanSquare per worker: pass worker=<int32 id>."
            )

        def correction(g, w, w_bak, lam_t):
            # Cast back so a float32 hyperparameter never promotes a bf16 gradient.
            return (g + lam_t * g * g * (w - w_bak)).astype(g.dtype)

        if not keeps_mean_square:
            new = jax.tree.map(lambda g, w, wb: correction(g, w, wb, lam), updates, params, stale_params)
            return new, state

        def new_mean_square(ms, g):
            # m * ms + (1 - m) * g^2, written with m alone so a traced m (inject_hyperparams) rounds like a float one.
            g2 = g * g
            return g2 + mean_square_decay * (ms - g2)

        if per_worker:
            take = lambda ms: jax.lax.dynamic_index_in_dim(ms, worker, axis=0, keepdims=False)
            put = lambda ms, m: jax.lax.dynamic_update_index_in_dim(ms, m.astype(ms.dtype), worker, axis=0)
            # Write the worker's new MeanSquare, then read it back for lambda: everything after the write reads the new
            # stack, so XLA updates it in place (read from the old stack, lambda's use raced the write and XLA copied
            # the whole M x params stack on every push: 2 x 16 MB for 1.1M parameters and M = 4).
            mean_square = jax.tree.map(lambda ms, g: put(ms, new_mean_square(take(ms), g)), state.mean_square, updates)
            ms_w = jax.tree.map(take, mean_square)
        else:
            ms_w = jax.tree.map(new_mean_square, state.mean_square, updates)
            mean_square = jax.tree.map(lambda ms, m: m.astype(ms.dtype), state.mean_square, ms_w)
        adaptive_lam = lambda ms: jnp.where(adaptive, lam / jnp.sqrt(ms + eps), lam)
        new = jax.tree.map(
            lambda g, w, wb, ms: correction(g, w, wb, adaptive_lam(ms)),
            updates,
            params,
            stale_params,
            ms_w,
        )
        return new, ScaleByDelayCompensationState(mean_square=mean_square)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@recipe(elementwise=True)
def dc_asgd(
    learning_rate: ScalarOrSchedule,
    lam: float | jax.Array = 0.04,
    *,
    adaptive: bool | jax.Array = False,
    mean_square_decay: float | jax.Array = 0.95,
    eps: float | jax.Array = 1e-7,
    num_workers: int | None = None,
    momentum: float | None = None,
    nesterov: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""DC-ASGD: delay-compensated asynchronous SGD.

    .. math::
        w_{t+1} = w_t - \eta_t \left(g_m + \lambda_t\, g_m \odot g_m \odot (w_t - w_{bak}(m))\right)

    The compensation (:func:`scale_by_delay_compensation`) is applied to the raw gradient, before momentum; with
    ``momentum`` the compensated gradient feeds optax's heavy-ball (or Nesterov) trace. Any weight decay chained
    *before* this rule (``optax.chain(optax.add_decayed_weights(wd), dc_asgd(...))``) is compensated too; chained
    after the compensation it is not.

    Args:
      learning_rate: a float or an optax schedule over server updates (paper CIFAR-10: 0.5, divided by 10 at epochs
        80 and 120).
      lam: :math:`\lambda_0` (paper: 0.04 for DC-ASGD-c, 2 for DC-ASGD-a).
      adaptive: ``True`` for DC-ASGD-a; a (traced) boolean, or a number (above 0.5: -a), so that a study's variants
        of -c and -a share one program.
      mean_square_decay: ``m`` of DC-ASGD-a's ``MeanSquare``.
      eps: :math:`\epsilon` of DC-ASGD-a.
      num_workers: keep ``MeanSquare`` per worker (see :func:`scale_by_delay_compensation`).
      momentum: optional heavy-ball momentum in [0, 1).
      nesterov: Nesterov momentum.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` whose ``update`` requires ``stale_params``.

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> rule = asgd_jax.dc_asgd(learning_rate=0.1, lam=0.5)
      >>> w_t, w_bak, g = jnp.array([1.0, 2.0]), jnp.array([0.0, 2.0]), jnp.array([2.0, 3.0])
      >>> updates, _ = rule.update(g, rule.init(w_t), w_t, stale_params=w_bak)
      >>> updates
      Array([-0.4, -0.3], dtype=float32)

    References:
      Zheng et al., "Asynchronous Stochastic Gradient Descent with Delay Compensation", ICML 2017, Eq. 10.
    """
    if not isinstance(adaptive, bool):  # a 0/1 number (a study's traced hp) is a flag, as a boolean array is
        if isinstance(adaptive, int | float):
            adaptive = adaptive > 0.5
        elif jnp.asarray(adaptive).dtype != jnp.bool_:
            adaptive = jnp.asarray(adaptive) > 0.5
    return optax.chain(
        scale_by_delay_compensation(
            lam,
            adaptive=adaptive,
            mean_square_decay=mean_square_decay,
            eps=eps,
            num_workers=num_workers,
        ),
        common.sgd(learning_rate, momentum, nesterov),
    )
