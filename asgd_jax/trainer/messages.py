"""What the trainer's parts tell each other, typed: a worker's weights and a store's answer, the store's status and
times, a driver's poll, a worker's stats, and the store's refusals.

Every value that crosses between the store, its endpoint, the workers, the driver and the session (in one process or
between Ray actors) is one of these: a typo is an ``AttributeError`` at once, not a ``KeyError`` at the end of a run.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, NamedTuple, SupportsFloat, SupportsInt

__all__ = [
    "ANSWERS",
    "Answer",
    "BadPush",
    "Checked",
    "Computed",
    "Finished",
    "Ignored",
    "Progress",
    "Snapshot",
    "StaleRound",
    "StoreClosed",
    "StoreStatus",
    "StoreTimes",
    "Sync",
    "Weights",
    "WorkerStats",
]

ANSWERS = ("ok", "rejected", "closed", "resync", "restart")
"""What a store answers a push with: applied (the fresh weights come back), rejected (NaN/Inf: re-sync and go on),
closed (the run is over, or the store stopped), resync (computed at weights the store no longer has: a restarted
store, an SSGD round already past) or restart (a round method's computation its round's end stopped: compute again
at the weights that come back, on the same minibatches)."""


class Weights(NamedTuple):
    """Weights a worker computes at: the parameters, the model state and the version they were pulled at (a pipelined
    store's answer: an int32 scalar still on the device, which the worker's computation reads as it is)."""

    params: Any
    model_state: Any
    version: SupportsInt


@dataclasses.dataclass(frozen=True)
class Checked:
    """A packed payload with its finite check, made where the payload was (the worker's program: on its device, while
    the store applies other pushes), so the store's exchange reads no pass of it for that. The store trusts the flag:
    a payload from elsewhere comes plain, and the store checks it.

    Attributes:
      payload: the packed buffers.
      finite: a bool array, whether the payload and the model state pushed with it hold no NaN or Inf.

    (A dataclass, not a tuple: it is never mistaken for packed buffers.)
    """

    payload: tuple
    finite: Any


class Sync(NamedTuple):
    """Where a worker (re)starts: its backup in the store, its data position (pushes applied or rejected) and the
    leaves of its inner optimizer's state as of its last applied push (``None``: none kept, a fresh one)."""

    weights: Weights
    position: int
    inner: list | None = None


class Computed(NamedTuple):
    """A push whose payload the store computes: a worker on the store's own device (a pipelined store in this process)
    hands over its exchange period and minibatches, and the store runs the period at the worker's backup and the
    exchange as one program (one dispatch per update, nothing handed between programs).

    Attributes:
      work: the worker's period, :func:`asgd_jax.exchange.worker_function`'s (one program: ``n_sync`` 1, or a scan).
      batches: its ``n_sync`` minibatches, stacked (host arrays: they cross to the device in the program's call).
      model_key: the run's model key, on the store's device.
      local_lr: the local steps' learning rate (float32), on the store's device.
    """

    work: Any
    batches: Any
    model_key: Any
    local_lr: Any


class Ignored(NamedTuple):
    """The weights a push was answered with when the store applied nothing of it: ignored as too stale (Ringmaster's
    threshold), or the round it completed was rejected (a NaN/Inf mean). The worker goes on at them, as after an
    applied push, but what its period did to its own state (an inner optimizer's) does not count."""

    params: Any
    model_state: Any
    version: SupportsInt


class Answer(NamedTuple):
    """A store's answer to a push (see :data:`ANSWERS`); ``weights`` for ``"ok"``, ``why`` otherwise; ``loss``: a
    :class:`Computed` push's training loss (on the device); ``applied``: whether an ``"ok"`` push changed the weights
    (not one the store ignored, :class:`Ignored`)."""

    status: str
    weights: Weights | None
    why: str = ""
    loss: Any = None
    applied: bool = True

    def fresh(self) -> Weights:
        """The weights an ``"ok"`` or ``"restart"`` answer carries (the worker computes at them next)."""
        if self.weights is None:
            raise RuntimeError(f"a {self.status!r} answer without weights: {self.why}")
        return self.weights


class StoreTimes(NamedTuple):
    """Where the store's time went this session, in seconds (``summary.json``'s ``"store"``).

    Attributes:
      pushes: pushes its applier handled (applied, rejected as NaN/Inf, ignored as too stale, late).
      exchange: its exchange programs, from dispatch to the answer on the host (the device's share; pipelined, the
        dispatch and the wait for the outcome on the device, which for a computed push is the worker's period and
        the exchange: one program).
      bookkeeping: the rest of a push on the applier: counts, the trace line, a checkpoint handed to its writer,
        snapshots, the answer handed back.
      idle: the store between the end of one push and the start of the next (the workers, not the store, set the
        pace).
      transfer_in: the pushing threads moving payloads to the store's device (overlapping the applier's work).
    """

    pushes: int = 0
    exchange: float = 0.0
    bookkeeping: float = 0.0
    idle: float = 0.0
    transfer_in: float = 0.0

    def plus(self, other: StoreTimes) -> StoreTimes:
        """The two added up, field by field."""
        return StoreTimes(*map(operator.add, self, other))


class StoreStatus(NamedTuple):
    """The counts and how a store stands (what a driver polls and a session ends with).

    ``received == applied + rejected + ignored`` always; ``late`` counts the rejected pushes that merely arrived after
    the store closed; ``ignored`` the pushes ignored as too stale (Ringmaster; Rennala without stops); ``positions``
    is each worker's data position (its minibatch periods used by applied, rejected or ignored pushes)."""

    applied: int
    rejected: int
    late: int
    received: int
    closed: bool
    error: str | None
    resumed_from: int
    positions: tuple[int, ...]
    staleness_counts: dict[int, int]
    ignored: int = 0
    times: StoreTimes = StoreTimes()


class Snapshot(NamedTuple):
    """Host copies of the server's weights right after update ``version`` (to evaluate), and when the store took them
    (``time.time()``: a wall clock, so that a store in another process, or on another machine of a Ray cluster, and
    the driver agree on it within the machines' clock sync)."""

    version: int
    params: Any
    model_state: Any
    taken: float


class Progress(NamedTuple):
    """A driver's poll of a store: its status, the losses pushed since the last poll and the snapshots taken since."""

    status: StoreStatus
    losses: list[float]
    snapshots: list[Snapshot]

    def followed_by(self, later: Progress) -> Progress:
        """This poll and a later one as one: the later status, both polls' losses and snapshots (the workers' last
        pushes, answered "closed" after the store's final poll, are counted in the run's totals)."""
        return Progress(later.status, self.losses + later.losses, self.snapshots + later.snapshots)


class BadPush(ValueError):
    """A push that does not fit the model (structure, shape, dtype) or holds NaN/Inf."""


class StoreClosed(RuntimeError):
    """The store stopped taking pushes (the step budget is reached, or it was closed)."""


class StaleRound(RuntimeError):
    """An SSGD payload computed at other weights than the store's (a worker that must re-sync, e.g. after a restart
    of the store)."""


@dataclasses.dataclass
class WorkerStats:
    """Where one worker's time went (seconds, this session), the same on every backend.

    Attributes:
      pushes: payloads it sent.
      compute: its exchange period on its devices, the transfers around it included (a straggler's extra time too).
      data: waiting for minibatches.
      exchange: waiting for the store's answer (push applied, fresh weights back) or, in SSGD, for the round.
      total: its whole loop (the three above).
      losses: the training loss of each push.
      stopped: computations stopped as too stale (Ringmaster with stops); their time is in ``compute`` and
        ``wasted``.
      wasted: the seconds of the stopped computations.
    """

    pushes: int = 0
    compute: float = 0.0
    data: float = 0.0
    exchange: float = 0.0
    total: float = 0.0
    losses: list[SupportsFloat] = dataclasses.field(default_factory=list)
    stopped: int = 0
    wasted: float = 0.0

    def add(self, *, data: float, compute: float, exchange: float, loss: SupportsFloat | None) -> None:
        """One push: its times and its loss (a device scalar while the worker runs: :meth:`settled` reads them;
        ``None`` for a push whose period never ran: a computed push that found the store closed)."""
        self.pushes += 1
        self.data, self.compute, self.exchange = self.data + data, self.compute + compute, self.exchange + exchange
        self.total += data + compute + exchange
        if loss is not None:
            self.losses.append(loss)

    def merged(self, other: WorkerStats | None) -> WorkerStats:
        """These stats and ``other``'s (a worker restarted within a session), summed."""
        if other is None:
            return self
        return WorkerStats(
            self.pushes + other.pushes,
            self.compute + other.compute,
            self.data + other.data,
            self.exchange + other.exchange,
            self.total + other.total,
            self.losses + other.losses,
            self.stopped + other.stopped,
            self.wasted + other.wasted,
        )

    def settled(self) -> WorkerStats:
        """These stats with every loss a float (a worker's losses stay on its device until its loop ends)."""
        return dataclasses.replace(self, losses=[float(x) for x in self.losses])

    def stop(self, seconds: float) -> None:
        """One computation stopped after ``seconds``."""
        self.stopped += 1
        self.wasted += seconds
        self.compute += seconds
        self.total += seconds

    @property
    def overhead(self) -> float:
        """Fraction of the worker's time spent outside its exchange period's computation."""
        return 1.0 - self.compute / self.total if self.total > 0 else 0.0


class Finished(NamedTuple):
    """A worker that ended: its stats, or why it failed."""

    worker: int
    stats: WorkerStats | None
    error: str | None = None
