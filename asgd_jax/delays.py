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

__all__ = ["Event", "FixedDelay", "RandomDelay", "Structure", "Trace", "Workers", "is_delay_model", "split"]

COMPUTE_TIME_KINDS = ("exponential", "constant", "lognormal")


class Event(NamedTuple):
    """One server update as the delay model sees it.

    Attributes:
      push_slot: slot whose backup the pushed gradient was computed at (int32).
      pull_slot: slot that records a snapshot of the new weights after the update (int32).
      shard: data shard the pushing worker reads (int32).
      time: virtual time of the update (float32).
      skip: minibatch periods the shard skips before this push (int32): a replayed trainer run's pushes rejected as
        NaN/Inf, which used up their minibatches and changed no weight (:class:`Trace`); 0 for every drawn model.
    """

    push_slot: jax.Array
    pull_slot: jax.Array
    shard: jax.Array
    time: jax.Array
    skip: Any = 0


def is_delay_model(value: Any) -> bool:
    """Whether ``value`` offers the delay-model interface the engines use: static ints ``num_slots`` (backups the
    server keeps) and ``num_shards`` (data shards), and pure, traceable ``init(key, n_sync) -> state`` and
    ``next(state, t, key, n_sync) -> (state, Event)`` (``key`` already folded with the update index ``t``)."""
    return all(hasattr(value, a) for a in ("num_slots", "num_shards", "init", "next"))


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
      >>> a == b, len(numbers)  # mean_compute_time, sigma, straggler_slowdown (the zeros are structure)
      (True, 3)
    """
    leaves, treedef = jax.tree.flatten(model)
    literal = lambda x: isinstance(x, int | float) and not isinstance(x, bool) and x == 0
    zeros = tuple((i, x) for i, x in enumerate(leaves) if literal(x))
    numbers = [x for x in leaves if not literal(x)]
    return Structure(treedef, zeros), numbers


def _pytree_dataclass(cls, meta: tuple[str, ...]):
    cls = dataclasses.dataclass(frozen=True)(cls)
    data = tuple(f.name for f in dataclasses.fields(cls) if f.name not in meta)
    return jax.tree_util.register_dataclass(cls, data_fields=list(data), meta_fields=list(meta))


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


class Workers:
    """M event-driven workers with random compute times (the default delay model).

    Each worker's time per minibatch is ``mean_compute_time / speeds[w]`` scaled by a draw of ``compute_time``
    (``"exponential"`` with mean 1, ``"constant"`` 1, or ``"lognormal"`` with mean 1 and log-std ``sigma``), times
    ``straggler_slowdown`` with probability ``straggler_prob``; each exchange adds ``comm_time``. The next push comes
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

    @property
    def num_slots(self) -> int:
        return self.num

    @property
    def num_shards(self) -> int:
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
        else:  # lognormal with mean 1: exp(sigma * z - sigma^2 / 2)
            sigma = jnp.asarray(self.sigma, jnp.float32)
            base = jnp.exp(sigma * jax.random.normal(k_time, shape, jnp.float32) - 0.5 * sigma * sigma)
        # A literal 0.0 (the default) needs no draw; a traced or non-zero probability does.
        if not (isinstance(self.straggler_prob, int | float) and self.straggler_prob == 0):
            k_strag = jax.random.fold_in(key, 1)
            straggle = jax.random.bernoulli(k_strag, jnp.asarray(self.straggler_prob, jnp.float32), shape)
            base = jnp.where(straggle, base * jnp.asarray(self.straggler_slowdown, jnp.float32), base)
        if self.speeds is not None:
            speeds = jnp.asarray(self.speeds, jnp.float32)
            speeds = speeds[worker] if worker is not None else speeds.reshape((1,) * (len(shape) - 1) + (self.num,))
            base = base / speeds
        return base * jnp.asarray(self.mean_compute_time, jnp.float32)

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


class Trace:
    """Pushes arrive in exactly the given order of workers; each worker pulls right after it pushes.

    All workers start from w_0. This replays a recorded run: ``Trace.load("runs/x/trace.jsonl")``.

    Args:
      worker_ids: the pushing worker of every update, ints in ``[0, num)``.
      num: number of workers (static); defaults to ``max(worker_ids) + 1``.
      times: optional virtual (or wall-clock) time of every update; defaults to ``1, 2, 3, ...``.
      skips: optional, per update: the pushing worker's pushes rejected (NaN/Inf) since its previous applied one. Each
        used up that worker's minibatches without changing a weight, so the replay skips as many exchange periods of
        its shard (``Trace.load`` reads them from the trace's rejected records).

    Example:
      >>> import asgd_jax
      >>> trace = asgd_jax.delays.Trace([0, 1, 1, 0])
      >>> trace.num, len(trace)
      (2, 4)
    """

    worker_ids: Any
    times: Any = None
    num: int | None = None
    skips: Any = None

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

    def __len__(self) -> int:
        return int(np.shape(self.worker_ids)[0])

    @property
    def num_slots(self) -> int:
        return self.num

    @property
    def num_shards(self) -> int:
        return self.num

    def init(self, key: jax.Array, n_sync: int = 1) -> jax.Array:
        del key, n_sync
        return jnp.zeros((), jnp.int32)

    def next(self, state: jax.Array, t: jax.Array, key: jax.Array, n_sync: int = 1):
        del key, n_sync
        worker = jnp.asarray(self.worker_ids, jnp.int32)[t]
        times = (t + 1).astype(jnp.float32) if self.times is None else jnp.asarray(self.times, jnp.float32)[t]
        skip = 0 if self.skips is None else jnp.asarray(self.skips, jnp.int32)[t]
        return state, Event(worker, worker, worker, times, skip)

    @classmethod
    def load(cls, path: str | os.PathLike, num: int | None = None) -> Trace:
        """Reads a trainer's ``trace.jsonl`` (:func:`asgd_jax.trace.read`: one record per applied or rejected push; a
        rejected one becomes a skip of its worker's next applied push).

        The number of workers is ``num``, or else the one the records say (a worker that never pushed still counts);
        a half-written last line (a killed run) is left out.
        """
        from asgd_jax import trace  # the trace format's owner (it imports nothing of the engines)

        read = trace.read(path)
        return cls(read.workers, read.times, num if num is not None else read.num, read.skips)


Trace = _pytree_dataclass(Trace, meta=("num",))


class _RingDelay:
    """Shared mechanics of the fixed-tau models: ``max_tau + 1`` snapshot slots read as a ring, one data stream."""

    @property
    def num_slots(self) -> int:
        return self._max_tau + 1

    @property
    def num_shards(self) -> int:
        return 1

    def init(self, key: jax.Array, n_sync: int = 1) -> jax.Array:
        del key, n_sync
        return jnp.zeros((), jnp.int32)

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
