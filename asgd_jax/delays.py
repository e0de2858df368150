"""Delay models: who pushes next, and at which weights their gradient was computed.

A delay model describes the asynchrony of a run as a pure, keyed schedule of events. The server keeps one backup
(snapshot of the weights plus the version it was taken at) per *slot*; every update is an :class:`Event` saying which
slot's backup the pushed gradient was computed at (``push``), which slot takes a fresh snapshot right after the update
(``pull``), which data shard the minibatch comes from and the virtual time of the update.

* :class:`Workers` is event-driven: M workers with random compute times; the one that finishes first pushes, then pulls
  (slot = worker = shard).
* :class:`Trace` replays a given order of pushing workers (e.g. a real trainer's ``trace.jsonl``).
* :class:`FixedDelay` and :class:`RandomDelay` are the classic analysis setting: the gradient applied at update t was
  computed at ``w_{max(0, t - tau)}``. They keep a ring of ``tau + 1`` snapshots as slots and read one data stream.

Static fields (the number of slots, the distribution's kind) shape the compiled program; numeric fields (mean compute
time, speeds, straggler probability, ...) are pytree leaves, so they may be traced or vmapped over.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from asgd_jax import errors

__all__ = [
    "Event",
    "FixedDelay",
    "MSync",
    "RandomDelay",
    "Rennala",
    "Ringmaster",
    "Round",
    "RoundTrace",
    "Structure",
    "Trace",
    "Workers",
    "computation_time",
    "is_delay_model",
    "is_round_model",
    "split",
    "sqrt_times",
]

COMPUTE_TIME_KINDS = ("exponential", "constant", "lognormal", "pareto")


class Event(NamedTuple):
    """One server update as the delay model sees it.

    Attributes:
      push_slot: slot whose backup the pushed gradient was computed at (int32).
      pull_slot: slot that records a snapshot of the new weights after the update (int32).
      shard: data shard the pushing worker reads (int32).
      time: virtual time of the update (float32).
      skip: minibatch periods the shard skips before this push (int32): a replayed trainer run's pushes rejected as
        NaN/Inf, or gradients a policy ignored (:class:`Ringmaster`), which used up their minibatches and changed no
        weight; the literal 0 for the models that never skip.
      worker: the pushing worker, when it is not the push slot (a ring of versions, :class:`Ringmaster`).
      busy: the workers' compute time so far, wasted work included (the models of the optimal-time methods).
      wasted: of ``busy``, the work that changed no weight: ignored gradients and stopped computations.
    """

    push_slot: jax.Array
    pull_slot: jax.Array
    shard: jax.Array
    time: jax.Array
    skip: Any = 0
    worker: Any = None
    busy: Any = None
    wasted: Any = None


class Round(NamedTuple):
    """One update of a round model (:class:`Rennala`, :class:`MSync`): the mean of ``K`` payloads, every one computed
    at the current weights w_t.

    Attributes:
      shards: int32 ``[K]``: the worker (and data shard) of every payload, in the order they are averaged; a worker
        may appear more than once (a fast worker gives several gradients in one Rennala round).
      skips: int32 ``[K]``: minibatch periods that worker used on ignored gradients just before this payload's.
      time: the virtual time the round ends (its last used gradient arrives).
      busy, wasted: as in :class:`Event`.
    """

    shards: jax.Array
    skips: jax.Array
    time: jax.Array
    busy: jax.Array
    wasted: jax.Array


def is_delay_model(value: Any) -> bool:
    """Whether ``value`` offers the delay-model interface the engines use: static ints ``num_slots`` (backups the
    server keeps) and ``num_shards`` (data shards), and pure, traceable ``init(key, n_sync) -> state`` and
    ``next(state, t, key, n_sync) -> (state, Event)`` (``key`` already folded with the update index ``t``), or, for a
    round model, ``round_size`` and ``round(state, t, key, n_sync) -> (state, Round)``."""
    return all(hasattr(value, a) for a in ("num_slots", "num_shards", "init")) and (
        hasattr(value, "next") or is_round_model(value)
    )


class Structure(NamedTuple):
    """A delay model's static part: its class and static fields (the pytree structure) and which leaves are literal
    zeros. Hashable: it keys a compiled program, and :meth:`build` puts the numbers back in, traced or not.

    A literal ``0`` stays in the structure rather than becoming a traced number, because a zero can switch work off
    (``Workers(straggler_prob=0.0)`` draws no stragglers); every other number is an argument of the program.
    """

    treedef: Any
    zeros: tuple[tuple[int, Any], ...]  # (leaf index, the literal) of every literal-zero leaf

    def build(self, numbers: list[Any]) -> Any:
        """The delay model with ``numbers`` (the non-zero leaves, in order) put back."""
        numbers, zeros = iter(numbers), dict(self.zeros)
        leaves = [zeros[i] if i in zeros else next(numbers) for i in range(self.treedef.num_leaves)]
        return jax.tree.unflatten(self.treedef, leaves)


def split(model: Any) -> tuple[Structure, list[jax.Array]]:
    """``model``'s :class:`Structure` and its numbers (as given): what a compiled program is keyed on, and what it
    takes as arguments (so a model with other speeds, times or probabilities reuses the program).

    Example:
      >>> import asgd_jax
      >>> a, numbers = asgd_jax.delays.split(asgd_jax.delays.Workers(4, mean_compute_time=2.0))
      >>> b, _ = asgd_jax.delays.split(asgd_jax.delays.Workers(4, mean_compute_time=3.0))
      >>> a == b, len(numbers)  # all but straggler_prob and noise, whose zeros switch draws off: structure
      (True, 7)
      >>> split(asgd_jax.delays.Workers(4, speeds=[1.0, 2.0, 1.0, 0.5]))[0] == a  # a uniform cluster: speeds 1
      True
    """
    leaves, treedef = jax.tree.flatten(_as_compiled(model))
    literal = lambda x: isinstance(x, int | float) and not isinstance(x, bool) and x == 0
    zeros = tuple((i, x) for i, x in enumerate(leaves) if literal(x))
    numbers = [x for x in leaves if not literal(x)]
    return Structure(treedef, zeros), numbers


_SWITCHES = ("straggler_prob", "noise")
"""The numbers of :class:`Workers` whose literal zero switches a draw off: structure, not an argument."""


def _as_compiled(model: Any) -> Any:
    """``model`` as its programs see it: a :class:`Workers` without ``speeds`` has speeds 1, and its numbers given as
    Python numbers are float32 (a ``comm_time`` of 0 included), so a uniform cluster without communication cost shares
    its programs with every cluster of its size and law, whether a number came as ``2.0`` or ``np.float32(2.0)``; the
    times are the same bit for bit (a time divided by 1, or plus 0, is itself; the draws compute in float32). So does
    the cluster a Ringmaster, Rennala or m-Synchronous model holds. A zero that switches a draw off stays structure."""
    if isinstance(model, Workers):
        changes = {k: np.ones(model.num, np.float32) for k in ("speeds", "times") if getattr(model, k) is None}
        for field in dataclasses.fields(model):
            value = getattr(model, field.name)
            if field.name == "num" or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if value == 0 and field.name in _SWITCHES:
                continue  # no stragglers, no noise: no draw
            changes[field.name] = np.float32(value)
        return dataclasses.replace(model, **changes) if changes else model
    if isinstance(getattr(model, "workers", None), Workers) and dataclasses.is_dataclass(model):
        return dataclasses.replace(model, workers=_as_compiled(model.workers))
    return model


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


def _pytree_dataclass(cls, meta: tuple[str, ...]):
    cls = dataclasses.dataclass(frozen=True, eq=False)(cls)
    cls.__eq__, cls.__hash__ = _equal, _hash
    data = tuple(f.name for f in dataclasses.fields(cls) if f.name not in meta)
    return jax.tree_util.register_dataclass(cls, data_fields=list(data), meta_fields=list(meta))


def _equal(a: Any, b: Any) -> bool:
    """Delay models are equal when they are of one class with equal static fields and equal numbers, arrays compared
    element by element (a dataclass's own ``==`` asks an array for one truth value and raises), a traced number equal
    only to itself."""
    if type(a) is not type(b):
        return NotImplemented
    (xs, xdef), (ys, ydef) = jax.tree.flatten(a), jax.tree.flatten(b)
    same = lambda x, y: x is y or (_is_concrete(x) and _is_concrete(y) and np.array_equal(x, y))
    return xdef == ydef and all(same(x, y) for x, y in zip(xs, ys, strict=True))


def _hash(model: Any) -> int:
    """The class and static fields (equal models have equal hashes; numbers, arrays among them, are not hashed)."""
    return hash(jax.tree.structure(model))


def _is_concrete(x: Any) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _check_int(name: str, value: Any, lowest: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < lowest:
        raise errors.ConfigError(f"{name}={value!r} is invalid: {name} must be an int >= {lowest}.")


def _check_array(name: str, value: Any, ok, expected: str, per_update: bool = False) -> None:
    """A number of a delay model (or, ``per_update``, an optional 1-D array of them): finite, ``ok``, not a bool.
    Traced values (a sweep's) are checked by the caller that made them."""
    if (value is None and per_update) or not _is_concrete(value):
        return
    try:
        array = np.asarray(value)
    except (TypeError, ValueError):
        array = np.asarray(None)
    numeric = array.dtype != bool and np.issubdtype(array.dtype, np.number)
    fits = array.ndim == 1 and array.size > 0 if per_update else array.ndim == 0
    if not (numeric and fits) or not bool(np.all(np.isfinite(array) & ok(array))):
        what = "a 1-D list of ints" if per_update else "a finite number"
        raise errors.ConfigError(f"{name}={value!r} is invalid: {name} must be {what} {expected}.")


class _Counted:
    """A model of ``num`` workers, each reading its own data shard."""

    @property
    def num_workers(self) -> int:
        return self.num

    @property
    def num_shards(self) -> int:
        return self.num


class _Stateless:
    """A model whose schedule needs no state between updates (a recorded one, a fixed ring)."""

    def init(self, key: jax.Array, n_sync: int = 1) -> jax.Array:
        del key, n_sync
        return jnp.zeros((), jnp.int32)


def _recorded_time(times: Any, t: jax.Array) -> jax.Array:
    """Update ``t``'s recorded time, or ``t + 1`` for a record without times."""
    return (t + 1).astype(jnp.float32) if times is None else jnp.asarray(times, jnp.float32)[t]


class Workers(_Counted):
    """M event-driven workers with random compute times (the default delay model).

    Each worker's time per minibatch is ``mean_compute_time / speeds[w]`` scaled by a draw of ``compute_time``
    (``"exponential"`` with mean 1, ``"constant"`` 1, ``"lognormal"`` with mean 1 and log-std ``sigma``, or
    ``"pareto"``: heavy-tailed with mean 1 and tail index ``alpha``), times ``straggler_slowdown`` with probability
    ``straggler_prob``, plus a half-normal ``|N(0, noise[w]^2)|`` (a new draw per minibatch); each exchange adds
    ``comm_time``. Fixed per-worker times: :meth:`with_times` (``Workers.with_times(sqrt_times(M), noise=...)`` is
    the optimal-time papers' cluster, times 1 + sqrt(i)), kept exactly as given (``times``, not speeds ``1 / t``: a
    float32 ``1 / (1 / t)`` is one ulp off t for 178 of the integers 1..1000). The next push comes
    from the worker that finishes first (ties go to the lower id); after pushing it pulls the fresh weights.

    Args:
      num: number of workers M >= 1 (static).
      compute_time: ``"exponential"`` (default), ``"constant"`` or ``"lognormal"`` (static).
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

    def __post_init__(self):
        _check_int("num", self.num, 1)
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

    def work_time(self, key: jax.Array, n_sync: int, worker: jax.Array | None = None) -> jax.Array:
        """Time of one exchange period (``n_sync`` minibatches plus ``comm_time``): ``[num]``, or a scalar for one
        ``worker``."""
        return self.draw(key, (n_sync,), worker).sum(axis=0) + jnp.asarray(self.comm_time, jnp.float32)

    def init(self, key: jax.Array, n_sync: int = 1) -> jax.Array:
        """The finish time of every worker's first push."""
        return self.work_time(key, n_sync)

    def next(self, finish: jax.Array, t: jax.Array, key: jax.Array, n_sync: int = 1):
        del t
        worker = jnp.argmin(finish).astype(jnp.int32)  # first minimum: ties go to the lower id
        time = finish[worker]
        finish = finish.at[worker].set(time + self.work_time(key, n_sync, worker))
        return finish, Event(worker, worker, worker, time)

    def sync_time(self, key: jax.Array, n_sync: int = 1) -> jax.Array:
        """Duration of one synchronous round: the slowest worker sets the pace (the barrier)."""
        return self.work_time(key, n_sync).max()


Workers = _pytree_dataclass(Workers, meta=("num", "compute_time"))


class Trace(_Counted, _Stateless):
    """Pushes arrive in exactly the given order of workers; each worker pulls right after it pushes (or, with
    ``pulled``, computes at the version given).

    All workers start from w_0. This replays a recorded run: ``Trace.load("runs/x/trace.jsonl")``.

    Args:
      worker_ids: the pushing worker of every update, ints in ``[0, num)``.
      num: number of workers (static); defaults to ``max(worker_ids) + 1``.
      times: optional virtual (or wall-clock) time of every update; defaults to ``1, 2, 3, ...``.
      skips: optional, per update: the pushing worker's pushes rejected (NaN/Inf) since its previous applied one. Each
        used up that worker's minibatches without changing a weight, so the replay skips as many exchange periods of
        its shard (``Trace.load`` reads them from the trace's rejected and ignored records).
      pulled: optional, per update t: the version its gradient was computed at (``t - pulled[t]`` its staleness), for
        a run whose workers did not always compute at the weights their own previous push brought back (a trainer's
        Ringmaster run: a too-stale push ignored and answered with the current weights, a stopped computation
        restarted there). The server then keeps a ring of ``ring`` versions, the largest staleness + 1, instead of a
        backup per worker.
      ring: the ring's length (static; default from a concrete ``pulled``).

    Example:
      >>> import asgd_jax
      >>> trace = asgd_jax.delays.Trace([0, 1, 1, 0])
      >>> trace.num, len(trace)
      (2, 4)
      >>> asgd_jax.delays.Trace([0, 1, 1, 0], pulled=[0, 0, 2, 2]).num_slots  # staleness at most 1: two versions
      2
    """

    worker_ids: Any
    times: Any = None
    num: int | None = None
    skips: Any = None
    pulled: Any = None
    ring: int | None = None

    def __post_init__(self):
        _check_array("skips", self.skips, lambda s: s >= 0, ">= 0 per update", per_update=True)
        ids = self.worker_ids
        if _is_concrete(ids):
            ids = np.asarray(ids)
            if ids.ndim != 1 or len(ids) == 0 or not np.issubdtype(ids.dtype, np.integer):
                raise errors.ConfigError(
                    f"worker_ids={self.worker_ids!r} is invalid: give a non-empty 1-D list of ints."
                )
            if ids.min() < 0:
                raise errors.ConfigError(f"worker_ids contains {ids.min()}: worker ids must be >= 0.")
            num = int(ids.max()) + 1 if self.num is None else self.num
            _check_int("num", num, 1)
            if ids.max() >= num:
                raise errors.ConfigError(
                    f"worker_ids contains {ids.max()} but num={num}: ids must be < num (or leave num=None)."
                )
            object.__setattr__(self, "num", int(num))
            object.__setattr__(self, "worker_ids", ids.astype(np.int32))
            for name in ("times", "skips"):
                if getattr(self, name) is not None and np.shape(getattr(self, name)) != ids.shape:
                    raise errors.ConfigError(
                        f"{name} has shape {np.shape(getattr(self, name))}: give one per worker id {ids.shape}."
                    )
            if self.skips is not None:
                object.__setattr__(self, "skips", np.asarray(self.skips).astype(np.int32))
        elif self.num is None:
            raise errors.ConfigError("Trace(worker_ids=<traced>) needs num= given explicitly.")
        self._check_pulled()

    def _check_pulled(self) -> None:
        if self.pulled is None:
            errors.require(self.ring is None, "ring", self.ring, "a ring replays pulled versions: give pulled too")
            return
        if not _is_concrete(self.pulled):
            errors.require(self.ring is not None, "ring", self.ring, "Trace(pulled=<traced>) needs ring= given")
            _check_int("ring", self.ring, 1)
            return
        _check_array("pulled", self.pulled, lambda p: p >= 0, ">= 0 per update", per_update=True)
        pulled = np.asarray(self.pulled).astype(np.int32)
        errors.require(
            pulled.shape == np.shape(self.worker_ids),
            "pulled",
            f"an array of shape {pulled.shape}",
            f"give one version per worker id {np.shape(self.worker_ids)}",
        )
        stale = np.arange(len(pulled)) - pulled
        errors.require(
            bool(np.all(stale >= 0)),
            "pulled",
            f"version {pulled[np.argmin(stale)]} at update {int(np.argmin(stale))}",
            "a gradient is computed at a version already made: pulled[t] <= t",
        )
        ring = int(stale.max()) + 1 if self.ring is None else self.ring
        _check_int("ring", ring, int(stale.max()) + 1)
        object.__setattr__(self, "pulled", pulled)
        object.__setattr__(self, "ring", ring)

    def __len__(self) -> int:
        return int(np.shape(self.worker_ids)[0])

    @property
    def num_slots(self) -> int:
        return self.num if self.ring is None else self.ring

    def next(self, state: jax.Array, t: jax.Array, key: jax.Array, n_sync: int = 1):
        del key, n_sync
        worker = jnp.asarray(self.worker_ids, jnp.int32)[t]
        times = _recorded_time(self.times, t)
        skip = 0 if self.skips is None else jnp.asarray(self.skips, jnp.int32)[t]
        if self.ring is None:
            return state, Event(worker, worker, worker, times, skip)
        # A ring of versions, as Ringmaster's: slot v % ring holds w_v from when v is made until v + ring is.
        source = jnp.asarray(self.pulled, jnp.int32)[t] % self.ring
        return state, Event(source, ((t + 1) % self.ring).astype(jnp.int32), worker, times, skip, worker)

    @classmethod
    def load(cls, path: str | os.PathLike, num: int | None = None) -> Trace:
        """Reads a trainer's ``trace.jsonl`` (:func:`asgd_jax.trace.read`: one record per applied or rejected push; a
        rejected one becomes a skip of its worker's next applied push).

        The number of workers is ``num``, or else the one the records say (a worker that never pushed still counts);
        a half-written last line (a killed run) is left out.
        """
        from asgd_jax import trace  # the trace format's owner (it imports nothing of the engines)

        read = trace.read(path)
        num = num if num is not None else read.num
        if read.rounds is not None:  # a round method's run (Rennala, m-Synchronous): every update a recorded round
            return RoundTrace(read.rounds, read.round_skips, read.times, num)
        return cls(read.workers, read.times, num, read.skips, read.pulled)


Trace = _pytree_dataclass(Trace, meta=("num", "ring"))


class RoundTrace(_Counted, _Stateless):
    """Recorded rounds, replayed (a trainer's Rennala or m-Synchronous run: :meth:`Trace.load` reads one back so).

    Update t averages ``K`` payloads, all computed at w_t: payload j is worker ``shards[t, j]``'s next minibatch, after
    ``skips[t, j]`` minibatch periods of its shard used by gradients that changed no weight (ignored as computed at an
    older iterate, or in a round rejected as NaN/Inf).

    Args:
      shards: int ``[updates, K]``: each round's workers, in the order their payloads are averaged.
      skips: optional int ``[updates, K]`` (default none).
      times: optional time of every update (default ``1, 2, 3, ...``).
      num: the number of workers M (default: the largest worker id + 1).

    Example:
      >>> import asgd_jax
      >>> rounds = asgd_jax.delays.RoundTrace([[0, 2], [1, 1], [2, 0]], num=3)
      >>> rounds.round_size, len(rounds)
      (2, 3)
    """

    shards: Any
    skips: Any = None
    times: Any = None
    num: int | None = None

    def __post_init__(self):
        shards = np.asarray(self.shards) if _is_concrete(self.shards) else None
        if shards is not None:
            ok = shards.ndim == 2 and shards.size > 0 and np.issubdtype(shards.dtype, np.integer)
            errors.require(ok, "shards", self.shards, "give a non-empty [updates, K] array of worker ids")
            errors.require(bool(shards.min() >= 0), "shards", int(shards.min()), "worker ids are >= 0")
            num = int(shards.max()) + 1 if self.num is None else self.num
            _check_int("num", num, int(shards.max()) + 1)
            object.__setattr__(self, "num", num)
            object.__setattr__(self, "shards", shards.astype(np.int32))
            if self.skips is not None:
                skips = np.asarray(self.skips)
                errors.require(
                    skips.shape == shards.shape and np.issubdtype(skips.dtype, np.integer) and bool(np.all(skips >= 0)),
                    "skips",
                    f"an array of shape {skips.shape}",
                    f"give one int >= 0 per payload, shape {shards.shape}",
                )
                object.__setattr__(self, "skips", skips.astype(np.int32))
            if self.times is not None:
                errors.require(
                    np.shape(self.times) == shards.shape[:1],
                    "times",
                    f"an array of shape {np.shape(self.times)}",
                    f"give one time per update, shape {shards.shape[:1]}",
                )
        elif self.num is None:
            raise errors.ConfigError("RoundTrace(shards=<traced>) needs num= given explicitly.")

    def __len__(self) -> int:
        return int(np.shape(self.shards)[0])

    num_slots = 1

    @property
    def round_size(self) -> int:
        return int(np.shape(self.shards)[1])

    def round(self, state: jax.Array, t: jax.Array, key: jax.Array, n_sync: int = 1):
        del key, n_sync
        shards = jnp.asarray(self.shards, jnp.int32)[t]
        skips = jnp.zeros_like(shards) if self.skips is None else jnp.asarray(self.skips, jnp.int32)[t]
        time = _recorded_time(self.times, t)
        return state, Round(shards, skips, time, None, None)


RoundTrace = _pytree_dataclass(RoundTrace, meta=("num",))


class _RingDelay(_Stateless):
    """Shared mechanics of the fixed-tau models: ``max_tau + 1`` snapshot slots read as a ring, one data stream."""

    @property
    def num_slots(self) -> int:
        return self._max_tau + 1

    @property
    def num_shards(self) -> int:
        return 1

    def _event(self, t: jax.Array, tau: jax.Array) -> Event:
        # Slot s holds w_v for the latest v <= t with v = s (mod H), so w_{max(0, t - tau)} sits in its slot.
        h = self.num_slots
        source = jnp.maximum(t - tau, 0) % h
        zero = jnp.zeros((), jnp.int32)
        return Event(
            source.astype(jnp.int32),
            ((t + 1) % h).astype(jnp.int32),
            zero,
            (t + 1).astype(jnp.float32),
        )


class FixedDelay(_RingDelay):
    """The gradient applied at update t is computed at ``w_{max(0, t - tau)}`` (classic fixed-delay analysis).

    Equivalent to ``tau + 1`` workers pushing round-robin; the minibatches come from one data stream.

    Args:
      tau: the delay, an int >= 0 (static: it sets the number of snapshots kept).

    Example:
      >>> import asgd_jax
      >>> asgd_jax.delays.FixedDelay(3).num_slots
      4
    """

    tau: int

    def __post_init__(self):
        _check_int("tau", self.tau, 0)

    @property
    def _max_tau(self) -> int:
        return self.tau

    def next(self, state, t, key, n_sync: int = 1):
        del key, n_sync
        return state, self._event(t, jnp.asarray(self.tau, jnp.int32))


FixedDelay = _pytree_dataclass(FixedDelay, meta=("tau",))


class RandomDelay(_RingDelay):
    """Like :class:`FixedDelay`, with tau drawn uniformly from ``0..max_tau`` for every update.

    Args:
      max_tau: the largest delay, an int >= 0 (static).

    Example:
      >>> import asgd_jax
      >>> asgd_jax.delays.RandomDelay(4).num_slots
      5
    """

    max_tau: int

    def __post_init__(self):
        _check_int("max_tau", self.max_tau, 0)

    @property
    def _max_tau(self) -> int:
        return self.max_tau

    def next(self, state, t, key, n_sync: int = 1):
        del n_sync
        tau = jax.random.randint(key, (), 0, self.max_tau + 1, jnp.int32)
        return state, self._event(t, tau)


RandomDelay = _pytree_dataclass(RandomDelay, meta=("max_tau",))


# --------------------------------------------------------------------------------------------------------------------
# The optimal-time methods' clusters: which gradients are used, ignored or stopped is decided by timing alone, so it
# is part of the schedule, computed before any gradient.
# --------------------------------------------------------------------------------------------------------------------


class ClusterState(NamedTuple):
    """Every worker's computation in progress, and the work done so far.

    Attributes:
      finish: float32 ``[M]``: when the computation in progress ends.
      began: float32 ``[M]``: when it began.
      start: int32 ``[M]``: the version (applied updates) of the weights it is computed at.
      skips: int32 ``[M]``: minibatch periods used on gradients that were ignored since the worker's last used one.
      clock: float32: the time of the last update.
      busy: float32: compute time of all workers so far, wasted work included (finished or stopped computations).
      wasted: float32: of ``busy``, the work that changed no weight (ignored gradients, stopped computations).
      begun: int32 ``[M]``: the computations each worker has begun (restarts after a stop included): the next one
        takes its worker's time number ``begun[w]`` (:func:`computation_time`).
      keys: the key data of every worker's sequence of times, ``[M, ...]``: ``fold_in(init key, w)`` (folded once, so
        a time costs one fold_in, not two).
    """

    finish: jax.Array
    began: jax.Array
    start: jax.Array
    skips: jax.Array
    clock: jax.Array
    busy: jax.Array
    wasted: jax.Array
    begun: jax.Array
    keys: jax.Array


def computation_time(workers: Workers, key: jax.Array, worker: jax.Array, count: jax.Array, n_sync: int = 1):
    """The time of computation number ``count`` (from 0) of ``worker`` in an optimal-time cluster (:class:`Ringmaster`,
    :class:`Rennala`) begun with ``key``: ``workers.work_time(fold_in(fold_in(key, worker), count), n_sync, worker)``.

    Every worker draws its own sequence of times, one per computation it begins, a restart after a stop included: the
    papers' model and their authors' simulators draw a computation's time when it starts, so a stopped computation
    does not keep the (long) time it had drawn, and the c-th computation of a worker takes the c-th time whatever the
    policy (runs with and without stops share their workers' times).

    Example:
      >>> import jax, asgd_jax
      >>> law = asgd_jax.delays.Workers.with_times([2.0, 3.0])
      >>> float(asgd_jax.delays.computation_time(law, jax.random.key(0), 1, 5))
      3.0
    """
    return workers.work_time(jax.random.fold_in(jax.random.fold_in(key, worker), count), n_sync, worker)


def _worker_keys(key: jax.Array, num: int) -> jax.Array:
    """The key data of every worker's sequence of times, ``fold_in(key, w)``."""
    key = key if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else jax.random.wrap_key_data(key)
    return jax.random.key_data(jax.vmap(lambda w: jax.random.fold_in(key, w))(jnp.arange(num, dtype=jnp.int32)))


def _time(workers: Workers, s: ClusterState, w: jax.Array, n_sync: int) -> jax.Array:
    """Worker ``w``'s next time (number ``begun[w]``): :func:`computation_time`, its worker's key folded in once."""
    return workers.work_time(jax.random.fold_in(jax.random.wrap_key_data(s.keys[w]), s.begun[w]), n_sync, w)


def _times(workers: Workers, s: ClusterState, n_sync: int) -> jax.Array:
    """Every worker's next time, ``[M]``."""
    return jax.vmap(lambda w: _time(workers, s, w, n_sync))(jnp.arange(workers.num, dtype=jnp.int32))


def _fresh(workers: Workers, key: jax.Array, n_sync: int) -> ClusterState:
    m = workers.num
    zero_f, zero_i = jnp.zeros((m,), jnp.float32), jnp.zeros((m,), jnp.int32)
    scalar = jnp.zeros((), jnp.float32)
    s = ClusterState(zero_f, zero_f, zero_i, zero_i, scalar, scalar, scalar, zero_i, _worker_keys(key, m))
    return s._replace(finish=_times(workers, s, n_sync), begun=zero_i + 1)


def _restart(workers: Workers, s: ClusterState, w, now, version, ignored: Any, n_sync: int) -> ClusterState:
    """Worker ``w``'s computation ends at ``now`` (its gradient used, or ``ignored``: a traced or Python bool), and it
    begins the next one, at ``version``'s weights, taking its next time. Only worker ``w``'s entries change (O(1) in a
    loop over arrivals)."""
    spent = now - s.began[w]
    work = _time(workers, s, w, n_sync)
    return s._replace(
        finish=s.finish.at[w].set(now + work),
        began=s.began.at[w].set(now),
        start=s.start.at[w].set(version),
        skips=s.skips.at[w].set(jnp.where(ignored, s.skips[w] + 1, 0)),
        busy=s.busy + spent,
        wasted=s.wasted + jnp.where(ignored, spent, 0.0),
        begun=s.begun.at[w].add(1),
    )


def _stop(workers: Workers, s: ClusterState, which: jax.Array, now, version, n_sync: int) -> ClusterState:
    """Stops the computations ``which`` (bool ``[M]``) at ``now``: their work is wasted, and they begin again at
    ``version``'s weights on the same minibatch (none is used up), each taking its worker's next time (a new draw, as
    any computation that begins)."""
    spent = jnp.where(which, now - s.began, 0.0).sum()
    return s._replace(
        finish=jnp.where(which, now + _times(workers, s, n_sync), s.finish),
        began=jnp.where(which, now, s.began),
        start=jnp.where(which, version, s.start),
        busy=s.busy + spent,
        wasted=s.wasted + spent,
        begun=s.begun + which.astype(jnp.int32),
    )


class _Cluster:
    """Shared by the optimal-time models: M workers drawn from a :class:`Workers` law."""

    @property
    def num_workers(self) -> int:
        return self.workers.num

    @property
    def num_shards(self) -> int:
        return self.workers.num

    def init(self, key: jax.Array, n_sync: int = 1) -> ClusterState:
        return _fresh(self.workers, key, n_sync)

    def _check(self, knob: str) -> None:
        """The law (or an int M), the model's static int ``knob`` (>= 1) and, where it has one, ``stops``."""
        object.__setattr__(self, "workers", _check_workers(self.workers))
        _check_int(knob, getattr(self, knob), 1)
        stops = getattr(self, "stops", False)
        errors.require(isinstance(stops, bool), "stops", stops, "give True or False")


def _check_workers(workers: Any) -> Workers:
    if errors.is_int(workers):
        return Workers(workers)
    if not isinstance(workers, Workers):
        raise errors.ConfigError(
            f"workers={workers!r} is invalid: give an asgd_jax.delays.Workers (the compute-time law) or an int M."
        )
    return workers


class Ringmaster(_Cluster):
    """Ringmaster ASGD's cluster (Maranjyan, Tyurin & Richtárik, ICML 2025, arXiv 2501.16168).

    Asynchronous workers drawn from ``workers``; a gradient whose delay (updates *applied* since its worker began it)
    is below ``threshold`` R is applied (x <- x - lr g with the arm's rule, plain SGD in the paper); otherwise it is
    ignored (its minibatch used, no weight changed, the version not advanced) and the worker restarts at the current
    weights. With ``stops=True`` every arriving gradient is applied and, after each update, a worker whose
    computation in progress has become R updates stale is stopped and restarted at the current weights. Every
    computation, a restart included, takes its worker's next time (:func:`computation_time`).

    The server keeps a ring of R weight versions (no backup per worker: M = 1,000 workers cost R copies of the
    weights), so R is static; the paper's hyperparameters are the step size and R (its quadratic script: R = 6).
    Lemma 4.1 (fixed times, with stops): any R consecutive updates finish within 2 min_m H_m (1 + R/m).

    Args:
      workers: the compute-time law (:class:`Workers`), or an int M for ``Workers(M)``.
      threshold: R >= 1 (static).
      stops: stop and restart a computation that has become R updates stale (static).

    Example:
      >>> import asgd_jax
      >>> cluster = asgd_jax.delays.Ringmaster(asgd_jax.delays.Workers(1000), threshold=6)
      >>> cluster.num_workers, cluster.num_slots
      (1000, 6)
    """

    workers: Any
    threshold: int = 1
    stops: bool = False

    def __post_init__(self):
        self._check("threshold")

    @property
    def num_slots(self) -> int:
        return self.threshold

    def next(self, s: ClusterState, t: jax.Array, key: jax.Array, n_sync: int = 1):
        del key  # the workers' times come from the cluster's own key (computation_time), one per computation begun
        law, r = self.workers, self.threshold

        def arrival(s):
            w = jnp.argmin(s.finish).astype(jnp.int32)
            return w, s.finish[w]

        if not self.stops:  # ignore (and restart) every arrival as stale as R or more, until one is applied

            def ignored(s):
                return t - s.start[arrival(s)[0]] >= r

            def ignore(s):
                w, now = arrival(s)
                return _restart(law, s, w, now, t, True, n_sync)

            s = jax.lax.while_loop(ignored, ignore, s)
        w, now = arrival(s)
        push_slot, skip = s.start[w] % r, s.skips[w]
        s = _restart(law, s, w, now, t + 1, False, n_sync)
        if self.stops:
            s = _stop(law, s, (t + 1 - s.start) >= r, now, t + 1, n_sync)
        s = s._replace(clock=now)
        event = Event(push_slot, (t + 1) % r, w, now, skip, w, s.busy, s.wasted)
        return s, event


Ringmaster = _pytree_dataclass(Ringmaster, meta=("threshold", "stops"))


class Rennala(_Cluster):
    """Rennala SGD's cluster (Tyurin & Richtárik, NeurIPS 2023, arXiv 2305.12387): rounds of S gradients.

    Every worker computes at the current weights x^k; the gradients computed at x^k are collected, as they arrive,
    until S have (a fast worker may give several, each on its next minibatch); then one update with their mean. A
    worker always begins at the newest iterate (the one whose gradient closes round k begins at x^{k+1}); a gradient
    computed at an older iterate is ignored (its minibatch used) and its worker restarts at x^k. With ``stops=True``
    every other worker is stopped at the round's end and restarts at x^{k+1} (the 2026 group code's semantics): then,
    with fixed times tau_i, a round takes exactly T_S = min{t : sum_i floor(t / tau_i) >= S}. Every computation,
    a restart included, takes its worker's next time (:func:`computation_time`).

    Every update is computed at w_t, so the server keeps no backup: one copy of the weights for any M.

    Args:
      workers: the compute-time law (:class:`Workers`), or an int M.
      batch: S >= 1 (static: the round's payloads are one batched gradient).
      stops: restart every worker at the new weights after each round (static).

    Example:
      >>> import asgd_jax
      >>> asgd_jax.delays.Rennala(asgd_jax.delays.Workers(16), batch=4).round_size
      4
    """

    workers: Any
    batch: int = 1
    stops: bool = False

    def __post_init__(self):
        self._check("batch")

    num_slots = 1

    @property
    def round_size(self) -> int:
        return self.batch

    def round(self, s: ClusterState, t: jax.Array, key: jax.Array, n_sync: int = 1):
        del key  # the workers' times come from the cluster's own key (computation_time), one per computation begun
        law, size = self.workers, self.batch
        shards = jnp.zeros((size,), jnp.int32)

        def collecting(c):
            return c[1] < size

        def arrive(c):
            s, count, shards, skips = c
            w = jnp.argmin(s.finish).astype(jnp.int32)
            now, fresh = s.finish[w], s.start[w] == t
            slot = jnp.minimum(count, size - 1)
            shards = shards.at[slot].set(jnp.where(fresh, w, shards[slot]))
            skips = skips.at[slot].set(jnp.where(fresh, s.skips[w], skips[slot]))
            # The gradient that closes the round makes x^{k+1}: its worker begins the next one there (the newest).
            version = jnp.where(fresh & (count == size - 1), t + 1, t)
            s = _restart(law, s, w, now, version, ~fresh, n_sync)
            return s, count + fresh.astype(jnp.int32), shards, skips

        zero = jnp.zeros((), jnp.int32)
        s, _, shards, skips = jax.lax.while_loop(collecting, arrive, (s, zero, shards, shards))
        now = s.began.max()  # the last arrival: every worker that finished this round began its next one then
        if self.stops:  # every computation still at x^k (all but the closing worker's) restarts at x^{k+1}
            s = _stop(law, s, s.start == t, now, t + 1, n_sync)
        s = s._replace(clock=now)
        return s, Round(shards, skips, now, s.busy, s.wasted)


Rennala = _pytree_dataclass(Rennala, meta=("batch", "stops"))


class MSync(_Cluster):
    """m-Synchronous SGD's cluster (Begunov & Tyurin 2026, arXiv 2602.03802): every round, all M workers start at the
    current weights; the first m gradients (one per worker) are averaged into one update, the other M - m
    computations are stopped at that moment and discarded. ``MSync(Workers(M), m=M)`` is synchronous minibatch SGD
    (``Plan(mode="sync")``), bit for bit: same draws, same minibatches, same mean.

    The rule is reconstructed from the paper's summary (the paper's own code was not read): UNCONFIRMED in detail.

    Args:
      workers: the compute-time law (:class:`Workers`), or an int M.
      m: 1 <= m <= M, the gradients per update (static).

    Example:
      >>> import asgd_jax
      >>> asgd_jax.delays.MSync(asgd_jax.delays.Workers(8), m=3).round_size
      3
    """

    workers: Any
    m: int = 1

    def __post_init__(self):
        self._check("m")
        if self.m > self.workers.num:
            raise errors.ConfigError(f"m={self.m} is invalid: at most the {self.workers.num} workers (m <= M).")

    num_slots = 1

    @property
    def round_size(self) -> int:
        return self.m

    def init(self, key: jax.Array, n_sync: int = 1) -> ClusterState:
        """Every round draws its own times (from the update's key, as SSGD): no computation is in progress between
        rounds."""
        del n_sync
        zero_f, zero_i = jnp.zeros((self.workers.num,), jnp.float32), jnp.zeros((self.workers.num,), jnp.int32)
        scalar = jnp.zeros((), jnp.float32)
        return ClusterState(
            zero_f, zero_f, zero_i, zero_i, scalar, scalar, scalar, zero_i, _worker_keys(key, self.workers.num)
        )

    def round(self, s: ClusterState, t: jax.Array, key: jax.Array, n_sync: int = 1):
        del t
        times = self.workers.work_time(key, n_sync)  # SSGD's draw (Workers.sync_time), every worker from the round
        if self.m == self.workers.num:
            shards, took = jnp.arange(self.m, dtype=jnp.int32), times.max()
            busy, wasted = times.sum(), jnp.zeros((), jnp.float32)
        else:
            first = jnp.argsort(times, stable=True)[: self.m]  # ties go to the lower id
            shards, took = jnp.sort(first).astype(jnp.int32), times[first[-1]]
            busy, wasted = times[first].sum() + (self.workers.num - self.m) * took, (self.workers.num - self.m) * took
        now = (s.clock + took).astype(jnp.float32)
        s = s._replace(clock=now, busy=s.busy + busy, wasted=s.wasted + wasted)
        return s, Round(shards, jnp.zeros((self.m,), jnp.int32), now, s.busy, s.wasted)


MSync = _pytree_dataclass(MSync, meta=("m",))


def is_round_model(model: Any) -> bool:
    """Whether every update of ``model`` is a round: the mean of ``round_size`` payloads computed at w_t."""
    return hasattr(model, "round_size") and hasattr(model, "round")
