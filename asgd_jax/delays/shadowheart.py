"""Shadowheart SGD's decisions (Tyurin, Pozzi, Ilin & Richtárik, NeurIPS 2024, arXiv 2402.04785): the equilibrium
time t* of a cluster whose workers take h_i per gradient and tau_i per compressed message, and each worker's share
of a round: b_i = floor(t* / h_i) gradients, m_i = floor(t* / tau_i) compressed messages, and the server's weights.

Decided from the cluster's numbers alone, before any gradient, as the optimal-time clusters decide theirs (host-side,
float64: the times are fixed numbers of the run); :class:`Shadowheart` is the round model that runs the method on
them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from asgd_jax import errors
from asgd_jax.delays.base import pytree_dataclass as _pytree_dataclass
from asgd_jax.delays.clusters import OfWorkers as _OfWorkers
from asgd_jax.delays.clusters import check_workers as _check_workers

__all__ = ["Shadowheart", "ShadowheartRound", "equilibrium_time", "shadowheart_round"]

_BISECTIONS = 200


def _times(name: str, values) -> np.ndarray:
    try:
        array = np.asarray(values, np.float64)
    except (TypeError, ValueError):
        array = np.zeros(0)
    ok = array.ndim == 1 and array.size > 0 and np.all(np.isfinite(array)) and np.all(array > 0)
    errors.require(bool(ok), name, values, "give one positive finite time per worker")
    return array


def equilibrium_time(compute_times, send_times, omega: float, sigma2_over_eps: float) -> float:
    r"""The equilibrium time t* of Shadowheart SGD (Definition 4.2 of the paper).

    Sort the workers by :math:`\max(h_i, \tau_i)`; for each prefix j of that order let :math:`s^*(j)` solve

    .. math::
        s = \Big[\sum_{i \le j} \frac{1}{2\tau_i\omega + 4\tau_i\omega h_i (\sigma^2/\varepsilon)/s
            + 2 h_i \sigma^2/\varepsilon}\Big]^{-1},

    and :math:`t^*(j) = \max\{\max(h_{\pi_j}, \tau_{\pi_j}), s^*(j)\}`; then :math:`t^* = \min_j t^*(j)`. The right
    side decreases in s, so each equation has one root, found here by bisection between
    :math:`[\sum_i 1/(2\tau_i\omega + 2h_i\sigma^2/\varepsilon)]^{-1}` (the right side at infinity) and the right side
    there. A prefix with a worker whose terms are all zero (no compression variance and no noise) takes the prefix's
    own bound, as the authors' code does.

    Args:
      compute_times: h_i, seconds per stochastic gradient, one per worker (> 0).
      send_times: tau_i, seconds per compressed message, one per worker (> 0).
      omega: the compressor's variance parameter (>= 0: RandK of d is d / K - 1; 0 without compression).
      sigma2_over_eps: sigma^2 / epsilon (>= 0), a tuning knob in the authors' experiments.

    Example:
      >>> from asgd_jax.delays.shadowheart import equilibrium_time
      >>> round(equilibrium_time([1.0, 1.0], [1.0, 1.0], omega=0.0, sigma2_over_eps=4.0), 3)  # 2 h sigma^2/eps / 2
      4.0
    """
    h, tau = _times("compute_times", compute_times), _times("send_times", send_times)
    errors.require(h.shape == tau.shape, "send_times", send_times, f"give {h.size} times, one per worker")
    omega = errors.finite_number("omega", omega, positive=False)
    r = errors.finite_number("sigma2_over_eps", sigma2_over_eps, positive=False)
    errors.require(omega >= 0 and r >= 0, "omega", (omega, r), "omega and sigma2_over_eps must be >= 0")
    order = np.argsort(np.maximum(h, tau), kind="stable")
    h, tau = h[order], tau[order]
    bound = np.maximum(h, tau)
    best = np.inf
    for j in range(h.size):
        hj, tj = h[: j + 1], tau[: j + 1]
        a, b = 2 * tj * omega + 2 * hj * r, 4 * tj * omega * hj * r
        if np.any(a <= 1e-12):
            best = min(best, bound[j])
            continue
        rhs = lambda s, a=a, b=b: 1.0 / np.sum(1.0 / (a + b / s))
        low = 1.0 / np.sum(1.0 / a)
        high = rhs(low)
        for _ in range(_BISECTIONS):
            mid = 0.5 * (low + high)
            low, high = (mid, high) if mid - rhs(mid) < 0 else (low, mid)
        best = min(best, max(bound[j], 0.5 * (low + high)))
    return float(best)


class ShadowheartRound(NamedTuple):
    """A round of Shadowheart SGD: its time t*, each worker's gradients ``b`` and compressed messages ``m`` (a worker
    with either 0 sits out), and the server's weight of each worker's messages (0 for those that sit out)."""

    time: float
    b: np.ndarray
    m: np.ndarray
    weights: np.ndarray


def shadowheart_round(compute_times, send_times, omega: float, sigma2_over_eps: float) -> ShadowheartRound:
    r"""Each worker's share of a Shadowheart round: :math:`b_i = \lfloor t^*/h_i \rfloor`,
    :math:`m_i = \lfloor t^*/\tau_i \rfloor`, and the weights :math:`w_i = 1/(b_i\omega + \omega\sigma^2/\varepsilon
    + m_i\sigma^2/\varepsilon)` of the step :math:`x \leftarrow x - \gamma \sum_i w_i \sum_{j \le m_i} C_{ij}(g_i) /
    \sum_i w_i m_i b_i` (Algorithm 1), with :math:`g_i` the sum of worker i's b_i gradients.

    Example:
      >>> from asgd_jax.delays.shadowheart import shadowheart_round
      >>> r = shadowheart_round([1.0, 3.0], [1.0, 1.0], omega=1.0, sigma2_over_eps=1.0)
      >>> round(r.time, 4), r.b.tolist(), r.m.tolist()
      (3.5375, [3, 1], [3, 3])
    """
    t = equilibrium_time(compute_times, send_times, omega, sigma2_over_eps)
    h, tau = _times("compute_times", compute_times), _times("send_times", send_times)
    b, m = np.floor(t / h + 1e-9).astype(np.int64), np.floor(t / tau + 1e-9).astype(np.int64)
    active = (b > 0) & (m > 0)
    r = float(sigma2_over_eps)
    with np.errstate(divide="ignore"):
        weights = np.where(active, 1.0 / (b * omega + omega * r + m * r), 0.0)
    return ShadowheartRound(t, b, m, weights)


class Shadowheart(_OfWorkers):
    """Shadowheart SGD's cluster (Tyurin, Pozzi, Ilin & Richtárik, NeurIPS 2024, Algorithm 1; the order of events of
    the authors' simulator): a round model whose every round, from x^k, worker i computes b_i = floor(t*/h_i)
    gradients one after another and sums them, then sends m_i = floor(t*/tau_i) independent compressions of the sum
    (RandK of ``fraction`` of the coordinates, scaled by 1/fraction; the identity without ``fraction``), one after
    another; the round ends when the last message arrives, after max_i (b_i h_i + m_i tau_i). The step is
    x^{k+1} = x^k - lr sum_i w_i sum_j C_ij(g_i) / sum_i w_i m_i b_i, w_i = 1 / (b_i omega + omega sigma^2/eps +
    m_i sigma^2/eps), a worker with b_i or m_i of 0 sitting out (:func:`shadowheart_round`); run it with the ``sgd``
    rule (the rule applies the combined step).

    b, m and the weights are decided on the host from the law's fixed times h_i (``Workers.with_times``), the send
    times tau_i, omega = 1/fraction - 1 and sigma^2/eps, so they shape the program (a cluster with other times
    compiles its own); the clock reads the law's numbers. Simulator only.

    Args:
      workers: a :class:`Workers` law of fixed times (``compute_time="constant"``): h_i.
      send_times: tau_i, the time to send one compressed message, one per worker (> 0).
      fraction: RandK's share of the coordinates a message keeps (in (0, 1]); None: no compression (omega = 0).
      sigma2_over_eps: sigma^2 / epsilon (>= 0), the method's knob (the authors tune it).

    Example:
      >>> import asgd_jax
      >>> law = asgd_jax.delays.Workers.with_times([1.0, 3.0])
      >>> c = asgd_jax.delays.Shadowheart(law, send_times=[1.0, 1.0], fraction=0.5, sigma2_over_eps=1.0)
      >>> c.b, c.m, c.round_size   # t* = 3.54: 3 + 1 gradients, 3 messages each
      ((3, 1), (3, 3), 4)
    """

    workers: Any
    send_times: Any = 1.0
    fraction: float | None = None
    sigma2_over_eps: float = 1.0
    b: tuple = ()
    m: tuple = ()
    weights: Any = None

    def __post_init__(self):
        law = _check_workers(self.workers)
        object.__setattr__(self, "workers", law)
        if self.b:  # rebuilt from its pytree: decided already
            return
        errors.require(
            law.compute_time == "constant" and law.straggler_prob == 0 and law.noise == 0,
            "workers",
            law,
            "Shadowheart decides its rounds from fixed compute times: give Workers.with_times(h)",
        )
        if self.fraction is not None:
            ok = isinstance(self.fraction, int | float) and not isinstance(self.fraction, bool)
            errors.require(ok and 0 < self.fraction <= 1, "fraction", self.fraction, "give a number in (0, 1]")
        speeds = np.ones(law.num) if law.speeds is None else np.asarray(law.speeds, np.float64)
        times = np.ones(law.num) if law.times is None else np.asarray(law.times, np.float64)
        h = float(np.asarray(law.mean_compute_time)) * times / speeds
        tau = np.broadcast_to(_times("send_times", np.atleast_1d(self.send_times)), (law.num,)).astype(np.float32)
        omega = 0.0 if self.fraction is None else 1.0 / self.fraction - 1.0
        r = shadowheart_round(h, tau, omega, self.sigma2_over_eps)
        errors.require(bool((r.weights > 0).any()), "send_times", self.send_times, "no worker can take part in a round")
        object.__setattr__(self, "send_times", np.asarray(tau, np.float32))
        object.__setattr__(self, "b", tuple(int(x) for x in np.where(r.weights > 0, r.b, 0)))
        object.__setattr__(self, "m", tuple(int(x) for x in np.where(r.weights > 0, r.m, 0)))
        object.__setattr__(self, "weights", (r.weights / np.sum(r.weights * r.m * r.b)).astype(np.float32))

    num_slots = 1

    @property
    def round_size(self) -> int:
        return sum(self.b)

    def init(self, key: jax.Array, n_sync: int = 1) -> jax.Array:
        del key, n_sync
        return jnp.zeros((2,), jnp.float32)  # the clock and the busy time

    def round(self, s: jax.Array, t: jax.Array, key: jax.Array, n_sync: int = 1):
        from asgd_jax.delays.base import Round

        del t
        h = self.workers.draw(key)  # the fixed times, from the law's numbers
        b, m = jnp.asarray(self.b, jnp.float32), jnp.asarray(self.m, jnp.float32)
        spent = b * h + m * jnp.asarray(self.send_times, jnp.float32)
        s = s + jnp.stack([spent.max(), spent.sum()])
        shards = jnp.asarray(np.repeat(np.arange(self.workers.num), self.b), jnp.int32)
        return s, Round(shards, jnp.zeros_like(shards), s[0], s[1], jnp.zeros((), jnp.float32))

    def combine(self, payloads: Any, key: jax.Array) -> Any:
        """The round's step direction from its ``round_size`` payloads (leaves ``[K, ...]``, worker by worker):
        sum_i w_i sum_{j <= m_i} C_ij(g_i) / sum_i w_i m_i b_i (the weights are normalised already)."""
        from jax.flatten_util import ravel_pytree

        num, owner = self.workers.num, jnp.asarray(np.repeat(np.arange(self.workers.num), self.b), jnp.int32)
        flat = jax.vmap(lambda p: ravel_pytree(p)[0])(payloads)  # [K, d]
        sums = jax.ops.segment_sum(flat, owner, num_segments=num)  # g_i: [M, d]
        d, m = flat.shape[1], np.asarray(self.m)
        if self.fraction is None:  # the identity: sum_j C_ij(g_i) = m_i g_i
            counts = jnp.asarray(m, jnp.float32)[:, None]
        else:  # m_i RandK masks per worker, each of k coordinates scaled by d / k
            k = max(1, round(self.fraction * d))
            draws = jax.random.uniform(key, (num, max(int(m.max()), 1), d))
            # [M, m_max, d]: each message's k coordinates, scattered (a one-hot of the k indices would be k x d each)
            mark = lambda index: jnp.zeros((d,), jnp.float32).at[index].set(1.0)
            kept = jax.vmap(jax.vmap(mark))(jax.lax.top_k(draws, k)[1])
            used = (jnp.arange(kept.shape[1])[None, :] < jnp.asarray(m)[:, None]).astype(jnp.float32)
            counts = (kept * used[:, :, None]).sum(axis=1) * (d / k)
        step = (jnp.asarray(self.weights)[:, None] * counts * sums).sum(axis=0)
        return ravel_pytree(jax.tree.map(lambda x: x[0], payloads))[1](step.astype(flat.dtype))


Shadowheart = _pytree_dataclass(Shadowheart, meta=("fraction", "sigma2_over_eps", "b", "m"))
