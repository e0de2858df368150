"""The worker-speed laws: :class:`Workers`, M event-driven workers with random (or fixed, :meth:`Workers.with_times`)
compute times, the default delay model and the law every optimal-time cluster draws from; :func:`sqrt_times`, the
optimal-time papers' heterogeneous cluster."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from asgd_jax import errors
from asgd_jax.delays.availability import Availability
from asgd_jax.delays.base import Counted as _Counted
from asgd_jax.delays.base import Event
from asgd_jax.delays.base import check_array as _check_array
from asgd_jax.delays.base import check_int as _check_int
from asgd_jax.delays.base import is_concrete as _is_concrete
from asgd_jax.delays.base import pytree_dataclass as _pytree_dataclass
from asgd_jax.delays.links import Links

COMPUTE_TIME_KINDS = ("exponential", "constant", "lognormal", "pareto")


def sqrt_times(num: int) -> np.ndarray:
    """The optimal-time papers' heterogeneous cluster: worker i (from 1) takes ``1 + sqrt(i)`` per gradient.

    Example:
      >>> import asgd_jax
      >>> asgd_jax.delays.sqrt_times(4).round(3).tolist()
      [2.0, 2.414, 2.732, 3.0]
    """
    _check_int("num", num, 1)
    return 1.0 + np.sqrt(np.arange(1, num + 1, dtype=np.float64))


def _per_worker(name: str, value: Any, num: int, positive: bool = False) -> Any:
    """A number, or one per worker (``[num]``), finite and >= 0 (``positive``: > 0); kept as given when it is a scalar
    (a literal 0 is structure: no draw), made one float32 array (one leaf) when it is a list."""
    ok, expected = (lambda v: v > 0, "> 0") if positive else (lambda v: v >= 0, ">= 0")
    if (
        not _is_concrete(value)
        or (isinstance(value, int | float) and not isinstance(value, bool))
        or np.ndim(value) == 0
    ):
        _check_array(name, value, ok, expected)
        return value
    try:
        if isinstance(value, bool | str | bytes):
            raise TypeError(name)
        array = np.asarray(value, np.float32)
    except (TypeError, ValueError):
        array = np.asarray(np.nan, np.float32)
    if array.ndim > 1 or (array.ndim == 1 and array.shape != (num,)) or not np.all(np.isfinite(array) & ok(array)):
        raise errors.ConfigError(f"{name}={value!r} is invalid: give one number {expected}, or {num} (one per worker).")
    return array if isinstance(value, np.ndarray | list | tuple) else value


class Workers(_Counted):
    """M event-driven workers with random compute times (the default delay model).

    Each worker's time per minibatch is ``mean_compute_time / speeds[w]`` scaled by a draw of ``compute_time``
    (``"exponential"`` with mean 1, ``"constant"`` 1, ``"lognormal"`` with mean 1 and log-std ``sigma``, or
    ``"pareto"``: heavy-tailed with mean 1 and tail index ``alpha``), times ``straggler_slowdown`` with probability
    ``straggler_prob``, plus a half-normal ``|N(0, noise[w]^2)|`` (a new draw per minibatch); each exchange adds
    ``comm_time``, and with ``links`` each worker's upload and download, which grow with the message (:class:`Links`).
    Fixed per-worker times: :meth:`with_times` (``Workers.with_times(sqrt_times(M), noise=...)`` is
    the optimal-time papers' cluster, times 1 + sqrt(i)), kept exactly as given (``times``, not speeds ``1 / t``: a
    float32 ``1 / (1 / t)`` is one ulp off t for 178 of the integers 1..1000). The next push comes
    from the worker that finishes first (ties go to the lower id); after pushing it pulls the fresh weights.

    Args:
      num: number of workers M >= 1 (static).
      compute_time: ``"exponential"`` (default), ``"constant"``, ``"lognormal"`` or ``"pareto"`` (static; the list is
        :data:`COMPUTE_TIME_KINDS`).
      mean_compute_time: mean time of one minibatch (> 0).
      sigma: log-std of the lognormal draw (>= 0).
      speeds: optional per-worker speed factors, shape ``[num]`` (> 0): a heterogeneous cluster.
      straggler_prob: probability in [0, 1] that a minibatch is slowed down.
      straggler_slowdown: factor >= 1 of such a slowdown.
      comm_time: time of one push + pull (>= 0).
      alpha: the Pareto tail index (> 1; the variance is finite only above 2).
      noise: the scale of the additive half-normal noise per minibatch (>= 0): one number, or one per worker.
      times: optional per-worker time factors, shape ``[num]`` (> 0): worker w's minibatch takes
        ``mean_compute_time * times[w] / speeds[w]`` times the draw; :meth:`with_times` sets them.
      links: optional :class:`Links`: every exchange also uploads the push and downloads the fresh weights, each in
        latency + bytes / bandwidth of its worker's link (the sizes default to the weights', filled by the simulator).
      availability: optional :class:`Availability`: online windows and dropouts with a time of return; a computation
        that would begin while its worker is away begins when it is back.
      dylu: Dynamic Local Updates (Liu et al. 2024, static): worker w runs only ``H_w = max(1, floor(v_w / max v *
        H))`` of the plan's ``n_sync = H`` minibatches per exchange (:meth:`local_steps`; ``v_w = speeds[w] /
        times[w]``, its speed), so that slow workers push as often as fast ones (asynchronous local SGD).

    Example:
      >>> import asgd_jax
      >>> asgd_jax.delays.Workers(8, compute_time="constant").num_slots
      8
    """

    num: int
    compute_time: str = "exponential"
    mean_compute_time: Any = 1.0
    sigma: Any = 0.5
    speeds: Any = None
    straggler_prob: Any = 0.0
    straggler_slowdown: Any = 10.0
    comm_time: Any = 0.0
    alpha: Any = 3.0
    noise: Any = 0.0
    times: Any = None
    links: Any = None
    availability: Any = None
    dylu: bool = False

    def __post_init__(self):
        _check_int("num", self.num, 1)
        errors.require(isinstance(self.dylu, bool), "dylu", self.dylu, "give True or False")
        if self.availability is not None:
            errors.require(
                isinstance(self.availability, Availability),
                "availability",
                self.availability,
                "give asgd_jax.delays.Availability(period=, online=, dropout_prob=, return_time=)",
            )
            object.__setattr__(self, "availability", self.availability.for_workers(self.num))
        if self.links is not None:
            errors.require(
                isinstance(self.links, Links), "links", self.links, "give asgd_jax.delays.Links(latency=, bandwidth=)"
            )
            object.__setattr__(self, "links", self.links.for_workers(self.num))
        if self.compute_time not in COMPUTE_TIME_KINDS:
            raise errors.ConfigError(
                f"compute_time={self.compute_time!r} is invalid: use one of {', '.join(COMPUTE_TIME_KINDS)}."
            )
        _check_array("mean_compute_time", self.mean_compute_time, lambda v: v > 0, "> 0")
        _check_array("sigma", self.sigma, lambda v: v >= 0, ">= 0")
        _check_array("straggler_prob", self.straggler_prob, lambda v: (v >= 0) & (v <= 1), "in [0, 1]")
        _check_array("straggler_slowdown", self.straggler_slowdown, lambda v: v >= 1, ">= 1")
        _check_array("comm_time", self.comm_time, lambda v: v >= 0, ">= 0")
        _check_array("alpha", self.alpha, lambda v: v > 1, "> 1 (a Pareto law with a finite mean)")
        object.__setattr__(self, "noise", _per_worker("noise", self.noise, self.num))
        if self.times is not None:
            times = _per_worker("times", self.times, self.num, positive=True)
            errors.require(np.ndim(times) == 1, "times", self.times, f"give {self.num} positive times, one per worker")
            object.__setattr__(self, "times", times)
        if self.speeds is not None and _is_concrete(self.speeds):
            try:
                if any(isinstance(v, bool | np.bool_ | str | bytes) for v in np.ravel(np.asarray(self.speeds, object))):
                    raise TypeError("speeds that are no numbers")
                with np.errstate(over="ignore"):  # a speed beyond float32 becomes inf, refused below
                    speeds = np.asarray(self.speeds, np.float32)
            except (TypeError, ValueError):
                speeds = np.zeros(0)
            if speeds.shape[-1:] != (self.num,) or not np.all(speeds > 0) or not np.all(np.isfinite(speeds)):
                raise errors.ConfigError(
                    f"speeds={self.speeds!r} is invalid: give {self.num} positive speed factors, one per worker."
                )
            if not isinstance(self.speeds, np.ndarray | jax.Array):  # one array (one leaf), not a list of numbers
                object.__setattr__(self, "speeds", speeds)

    @classmethod
    def with_times(cls, times: Any, **kwargs: Any) -> Workers:
        """Workers whose minibatch takes ``times[w]`` (fixed per-worker times, constant draws unless ``compute_time``
        says otherwise), e.g. ``Workers.with_times(sqrt_times(64), noise=0.1)``."""
        try:
            with np.errstate(divide="ignore", over="ignore"):
                times_ = np.asarray(times, np.float64)
        except (TypeError, ValueError):
            times_ = np.zeros(0)
        if times_.ndim != 1 or times_.size == 0 or not np.all(np.isfinite(times_) & (times_ > 0)):
            raise errors.ConfigError(f"times={times!r} is invalid: give a 1-D list of positive finite times.")
        kwargs.setdefault("compute_time", "constant")
        return cls(int(times_.size), times=times_.astype(np.float32), **kwargs)

    @property
    def num_slots(self) -> int:
        return self.num

    def draw(self, key: jax.Array, shape: tuple[int, ...] = (), worker: jax.Array | None = None) -> jax.Array:
        """Compute times of minibatches: ``shape + (num,)`` for every worker, or ``shape`` for one ``worker``."""
        if worker is None:
            shape = (*shape, self.num)
        # Not split(): the straggler key is derived only when it is used (one PRNG call less per update otherwise).
        k_time = key
        if self.compute_time == "constant":
            base = jnp.ones(shape, jnp.float32)
        elif self.compute_time == "exponential":
            base = jax.random.exponential(k_time, shape, jnp.float32)
        elif self.compute_time == "lognormal":  # mean 1: exp(sigma * z - sigma^2 / 2)
            sigma = jnp.asarray(self.sigma, jnp.float32)
            base = jnp.exp(sigma * jax.random.normal(k_time, shape, jnp.float32) - 0.5 * sigma * sigma)
        else:  # Pareto with mean 1: x_m * U^(-1/alpha), x_m = (alpha - 1) / alpha
            alpha = jnp.asarray(self.alpha, jnp.float32)
            u = jax.random.uniform(k_time, shape, jnp.float32, minval=jnp.finfo(jnp.float32).tiny, maxval=1.0)
            base = (alpha - 1.0) / alpha * u ** (-1.0 / alpha)
        # A literal 0.0 (the default) needs no draw; a traced or non-zero probability does.
        if not (isinstance(self.straggler_prob, int | float) and self.straggler_prob == 0):
            k_strag = jax.random.fold_in(key, 1)
            straggle = jax.random.bernoulli(k_strag, jnp.asarray(self.straggler_prob, jnp.float32), shape)
            base = jnp.where(straggle, base * jnp.asarray(self.straggler_slowdown, jnp.float32), base)
        if self.speeds is not None:
            speeds = jnp.asarray(self.speeds, jnp.float32)
            speeds = speeds[worker] if worker is not None else speeds.reshape((1,) * (len(shape) - 1) + (self.num,))
            base = base / speeds
        base = base * jnp.asarray(self.mean_compute_time, jnp.float32)
        if self.times is not None:  # after the mean: a time t of with_times is 1 * 1 * t, t exactly
            times = jnp.asarray(self.times, jnp.float32)
            base = base * (
                times[worker] if worker is not None else times.reshape((1,) * (len(shape) - 1) + (self.num,))
            )
        if not (isinstance(self.noise, int | float) and self.noise == 0):
            noise = jnp.asarray(self.noise, jnp.float32)
            if noise.ndim:
                noise = noise[worker] if worker is not None else noise.reshape((1,) * (len(shape) - 1) + (self.num,))
            base = base + noise * jnp.abs(jax.random.normal(jax.random.fold_in(key, 2), shape, jnp.float32))
        return base

    def local_steps(self, n_sync: int) -> jax.Array:
        """Every worker's minibatches per exchange period (int32 ``[num]``): ``n_sync``, or with :attr:`dylu`
        ``max(1, floor(v_w / max v * n_sync))``, ``v_w = speeds[w] / times[w]`` (the fastest runs all of them).

        Example:
          >>> import asgd_jax
          >>> asgd_jax.delays.Workers(4, speeds=[1.0, 0.5, 0.25, 0.1], dylu=True).local_steps(8).tolist()
          [8, 4, 2, 1]
        """
        if not self.dylu:
            return jnp.full((self.num,), n_sync, jnp.int32)
        speed = jnp.ones((self.num,), jnp.float32)
        if self.speeds is not None:
            speed = speed * jnp.asarray(self.speeds, jnp.float32)
        if self.times is not None:
            speed = speed / jnp.asarray(self.times, jnp.float32)
        fastest = speed.max()
        # (XLA divides by a reciprocal: 0.5 * 8 may come out 3.9999998. A millionth up keeps an exact share whole;
        # the fastest runs all of them.)
        steps = jnp.floor(speed / fastest * n_sync * (1.0 + 1e-6)).astype(jnp.int32)
        return jnp.clip(jnp.where(speed >= fastest, n_sync, steps), 1, n_sync)

    def work_time(self, key: jax.Array, n_sync: int, worker: jax.Array | None = None) -> jax.Array:
        """Time of one exchange period (``n_sync`` minibatches, the first :meth:`local_steps` of them with DyLU, plus
        ``comm_time``, and the links' upload and download): ``[num]``, or a scalar for one ``worker``."""
        draws = self.draw(key, (n_sync,), worker)
        if self.dylu:  # only the worker's own steps take time
            steps = self.local_steps(n_sync)
            steps = steps[worker] if worker is not None else steps[None, :]
            rows = jnp.arange(n_sync, dtype=jnp.int32).reshape((n_sync,) + (1,) * (draws.ndim - 1))
            draws = jnp.where(rows < steps, draws, 0.0)
        time = draws.sum(axis=0) + jnp.asarray(self.comm_time, jnp.float32)
        if self.links is None:
            return time
        up, down = self.links.times(worker, key)
        return time + (up + down)

    def init(self, key: jax.Array, n_sync: int = 1) -> jax.Array:
        """The finish time of every worker's first push (each begins at its first online instant)."""
        if self.availability is None:
            return self.work_time(key, n_sync)
        workers = jnp.arange(self.num, dtype=jnp.int32)
        return self.availability.next_online(jnp.zeros((self.num,), jnp.float32), workers) + self.work_time(key, n_sync)

    def next(self, finish: jax.Array, t: jax.Array, key: jax.Array, n_sync: int = 1):
        del t
        worker = jnp.argmin(finish).astype(jnp.int32)  # first minimum: ties go to the lower id
        time = finish[worker]
        begins = time if self.availability is None else self.availability.begin(key, worker, time)
        finish = finish.at[worker].set(begins + self.work_time(key, n_sync, worker))
        steps = self.local_steps(n_sync)[worker] if self.dylu else None
        return finish, Event(worker, worker, worker, time, steps=steps)

    def sync_time(self, key: jax.Array, n_sync: int = 1) -> jax.Array:
        """Duration of one synchronous round: the slowest worker sets the pace (the barrier)."""
        return self.work_time(key, n_sync).max()


Workers = _pytree_dataclass(Workers, meta=("num", "compute_time", "dylu"))
