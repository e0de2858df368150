"""The host-side parameter store: the simulator's server step, applied to pushes from real worker threads.

Workers ``pull`` the weights once and then ``push`` payloads; the pushes are applied one at a time, in arrival order (by
each pushing thread in turn under the applier's gate: see :mod:`asgd_jax.trainer.applier`), with the same pure
:func:`asgd_jax.server.push` the simulator scans, and right after applying a push records that worker's pull
(:func:`asgd_jax.server.pull`) and hands it the fresh weights. That push-then-pull is atomic, which is exactly the
simulator's semantics, so the recorded trace (``trace.jsonl``: one line per applied push) replays in the simulator as
``asgd_jax.delays.Trace.load(path)`` (the format is :mod:`asgd_jax.trace`'s).

Bad pushes never touch the model: a wrong tree structure, shape or dtype is rejected at ``push`` with a clear error;
a payload with NaN/Inf is rejected (counted) or, with ``on_nonfinite="stop"``, closes the store with a clear message.
Every push is counted exactly once as applied or rejected; ``late`` counts the rejected ones that merely arrived after
the store closed (in flight when the budget was reached).

Checkpoints (``checkpoint_dir``): the whole server state (weights, rule state, model state, every worker's backup and
pulled version, the version), the counts and each worker's data position (pushes it got applied or rejected as
non-finite: the minibatches it used up) go to ``checkpoint.npz``, written atomically (temporary file, fsync, rename:
a process killed mid-write leaves the previous one loadable) every ``checkpoint_every`` updates by a
:class:`asgd_jax.checkpoint.Writer` that never stalls the applier, and once more at :meth:`ParameterStore.close`.
``resume=True`` restores it and cuts ``trace.jsonl`` back to the checkpoint's version, so the trace of a resumed run
still replays in the simulator.

Workers talk to a store through its :class:`Endpoint` (in this process, or inside the Ray backend's store actor): the
one place where what the store says (applied, rejected, closed, a stale SSGD round) becomes a worker's
:class:`asgd_jax.trainer.messages.Answer`, and where a driver polls the run's :class:`StoreStatus`, the losses pushed
since its last poll and the snapshots of the weights to evaluate.

A trainer's store is made by :func:`asgd_jax.trainer.endpoint.for_run` from its config's
:class:`~asgd_jax.trainer.discipline.Discipline`. Nothing fails silently: a failing trace or checkpoint write (a full
disk), an exception in the applier, or weights that turn NaN/Inf close the store with ``error`` set, and the workers'
next push raises :class:`StoreClosed` saying why. The last checkpoint on disk stays the last good one.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future
from operator import attrgetter
from typing import Any

import jax
import numpy as np
import optax

from asgd_jax import checkpoint, errors, server
from asgd_jax.trainer.applier import Applier
from asgd_jax.trainer.discipline import Gather
from asgd_jax.trainer.ledger import Ledger
from asgd_jax.trainer.messages import BadPush, Computed, Snapshot, StaleRound, StoreClosed, StoreStatus, StoreTimes
from asgd_jax.trainer.persistence import Checkpoints, check_header, trace_pin
from asgd_jax.trainer.rounds import Rounds
from asgd_jax.trainer.state import StoreState, host_copy

__all__ = ["BadPush", "Gather", "ParameterStore", "StaleRound", "StoreClosed"]


log = logging.getLogger("asgd_jax.trainer.store")


class ParameterStore:
    """A parameter server on the host that applies pushes with a rule.

    Args:
      rule: the update rule (any optax transform of :mod:`asgd_jax.rules`).
      params: initial weights w_0.
      num_workers: M; worker ids are ``0..M-1``.
      model_state: initial non-trained model state (BatchNorm), or ``None``.
      num_updates: close after this many applied pushes (``None``: never).
      out_dir: if given, ``trace.jsonl`` is written there as pushes are applied.
      on_nonfinite: ``"reject"`` (count and drop the push) or ``"stop"`` (close the store with an error).
      device: where the server state lives (default: the first CPU device).
      checkpoint_dir: where ``checkpoint.npz`` goes (``None``: no checkpoints).
      checkpoint_every: write a checkpoint every this many applied updates (``None``: only at :meth:`close`).
      resume: restore ``checkpoint_dir``'s checkpoint if there is one; without ``resume`` an existing checkpoint is
        an error (it would be overwritten).
      header: JSON-able facts about the run stored with the checkpoint; a resume whose header differs in any key is
        refused (another worker count, batch size, data order...).
      snapshot_every: host copies of the weights are kept after every such update (:meth:`take_snapshots`).
      max_nonfinite: this many NaN/Inf pushes in a row stop the store (default: 10 per worker): a diverged model.
      threshold: Ringmaster ASGD's R: a push computed ``threshold`` or more updates ago is ignored (its minibatches
        used up, nothing applied, the trace says ``"ignored"``) and answered with the current weights, which become
        the worker's backup. ``None``: none is.
      gather: a round method's rounds (:class:`~asgd_jax.trainer.discipline.Gather`, :meth:`push_gathered`).
      pipelined: answer a push with its exchange's outputs on the device, read its flags when the next one arrives
        (:mod:`asgd_jax.trainer.applier`): for workers in this process, whose payloads stay on their devices.
    """

    def __init__(
        self,
        rule: optax.GradientTransformation,
        params: Any,
        num_workers: int,
        *,
        model_state: Any = None,
        num_updates: int | None = None,
        out_dir: str | os.PathLike | None = None,
        on_nonfinite: str = "reject",
        device: jax.Device | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every: int | None = None,
        resume: bool = False,
        header: dict[str, Any] | None = None,
        snapshot_every: int | None = None,
        max_nonfinite: int | None = None,
        threshold: int | None = None,
        gather: Gather | None = None,
        pipelined: bool = False,
    ):
        errors.positive_int("num_workers", num_workers)
        self.threshold = None if threshold is None else errors.positive_int("threshold", threshold)
        # Consecutive non-finite pushes that stop the run: a diverged model pushes nothing else, forever.
        self.max_nonfinite = max_nonfinite or 10 * num_workers
        self.diverged = False  # the weights turned NaN/Inf: no checkpoint of them is written
        self.device = device or jax.devices("cpu")[0]
        self.num_workers, self.num_updates, self.on_nonfinite = num_workers, num_updates, on_nonfinite
        self.pipelined = pipelined and threshold is None and gather is None
        self.server = StoreState(rule, params, model_state, num_workers, self.device)
        self.layout, self.model_state_layout = self.server.layout, self.server.model_state_layout
        self.ledger = Ledger(num_workers, out_dir, self._trace_failed)
        self._times, self._error_lock = StoreTimes(), threading.Lock()
        self.header = {"num_workers": num_workers, **(header or {})}
        self.checkpoints = Checkpoints(checkpoint_dir, checkpoint_every, self.fail)
        pin: tuple[int, str | None] = (0, None)  # a resume: the trace's lines and digest to keep
        if self.checkpoints.exists() and self.checkpoints.path is not None:
            if not resume:
                raise errors.ConfigError(
                    f"{checkpoint_dir} already holds a checkpoint ({self.checkpoints.path}): pass resume=True "
                    "(--resume) to continue that run, or choose another output folder."
                )
            pin = self._restore(self.checkpoints.path)
        self.lock = threading.Lock()  # the state and the books
        self.gather, self.rounds = gather, Rounds(self, gather)
        self._version_cv = threading.Condition()  # notified at every applied update and at close
        self._closed = threading.Event()
        self.error: BaseException | None = None
        self.snapshot_every = snapshot_every
        self.ledger.open_trace(*pin)
        self.applier = Applier(self)

    @property
    def applied(self) -> int:
        """Updates applied so far (a resumed run's included)."""
        return self.ledger.applied

    # -- the worker-facing API ----------------------------------------------------------------------------------------

    def pull(self, worker: int, *, packed: bool = False) -> tuple[Any, Any, int]:
        """Records ``worker``'s backup; returns ``(params, model_state, version)``: the weights it computes at (host
        arrays; ``packed``: as packed buffers, :attr:`layout`'s)."""
        _check_worker(worker, self.num_workers)
        with self.lock:
            return (*self.reply(self.server.pull(worker), packed), self.applied)

    def reply(self, answer: tuple, packed: bool) -> tuple[Any, Any]:
        """A packed answer as its caller wants it: packed, or as the model's pytrees (views)."""
        return answer if packed else self.server.unpack(answer)

    def push(
        self, worker, payload, pulled_version, model_state=None, round_info=None, *, packed=False, inner=None
    ) -> Future:
        """Applies a payload computed at the weights of ``pulled_version``: the model's pytree or its packed buffers
        (:attr:`layout`; a worker's come :class:`~asgd_jax.trainer.messages.Checked`), moved to the store's device on
        the pushing thread while the pushes before it are applied, then applied by that thread in its turn (a
        :class:`~asgd_jax.trainer.messages.Computed` one it computes too, its loss a fourth item of the answer).
        ``round_info``: a gathered round's mean; ``inner``: the inner-optimizer states its workers reached, by worker,
        kept for the checkpoints once it is applied (``Plan(inner=...)``).

        Returns:
          A future of ``(params, model_state, version)``: the weights right after this push, already this worker's
          backup (its next pull), as pytrees (``packed``: packed buffers); :class:`BadPush` for a rejected non-finite
          payload, :class:`StoreClosed` once the store stopped.

        Raises:
          BadPush: at once, for a payload whose structure, shapes or dtypes do not fit the model.
          StoreClosed: when the store no longer takes pushes.
        """
        _check_worker(worker, self.num_workers)
        computed = isinstance(payload, Computed)  # (Endpoint.push_computed)
        errors.require(self.pipelined or not computed, "payload", payload, "only a pipelined store computes a push")
        with self.lock:
            self.ledger.received += 1
            if self._closed.is_set():
                self.ledger.late_push()
                raise StoreClosed(self.closed_reason())
        if not computed:
            t0 = time.perf_counter()
            try:  # (checked here, while the pushes ahead are applied; moved to the store's device here, pipelined)
                payload, model_state = self.server.placed(worker, payload, model_state, packed, not self.pipelined)
            except BadPush:
                with self.lock:
                    self.ledger.rejected += 1
                raise
            self.add_times(StoreTimes(transfer_in=time.perf_counter() - t0))
        future: Future = Future()
        self.applier.put((worker, payload, model_state, pulled_version, round_info, packed, inner, future))
        return future

    def push_round(self, worker, payload, pulled_version, model_state=None, timeout=None, *, packed=False, inner=None):
        """SSGD: ``worker``'s payload for the round at ``pulled_version``, answered when all M have sent theirs and
        their mean is applied (:meth:`asgd_jax.trainer.rounds.Rounds.push_round`)."""
        _check_worker(worker, self.num_workers)
        return self.rounds.push_round(worker, payload, pulled_version, model_state, timeout, packed, inner)

    def push_gathered(
        self, worker, payload, pulled_version, model_state=None, timeout=None, *, packed=False, inner=None
    ):
        """A round method's payload (:attr:`gather`) computed at ``pulled_version``; the weights to go on at
        (:meth:`asgd_jax.trainer.rounds.Rounds.push_gathered`)."""
        _check_worker(worker, self.num_workers)
        return self.rounds.push_gathered(worker, payload, pulled_version, model_state, timeout, packed, inner)

    def abort_rounds(self, why: str) -> None:
        """Calls the rounds off (a worker died): every worker waiting in a round gets StoreClosed."""
        self.rounds.abort(why)

    def wait_version(self, version: int, timeout: float) -> int:
        """Waits up to ``timeout`` seconds for the store to reach ``version`` applied updates (or to close); returns
        the applied updates then (a worker's computation that has become too stale to use is stopped on it)."""
        with self._version_cv:
            self._version_cv.wait_for(lambda: self.applied >= version or self._closed.is_set(), timeout)
            return self.applied

    def notify_version(self) -> None:
        """Wakes whoever waits for a version (:meth:`wait_version`): an update was applied, or the store closed."""
        with self._version_cv:
            self._version_cv.notify_all()

    def backup(self, worker: int) -> tuple[Any, Any, int]:
        """``worker``'s backup: the weights, model state and version it last pulled (w_0 and 0 before any pull)."""
        _check_worker(worker, self.num_workers)
        with self.lock:
            return self.server.backup(worker)

    def packed_backup(self, worker: int) -> tuple[tuple, tuple, int]:
        """``worker``'s backup as packed host buffers (one program, one transfer per buffer) and its version."""
        _check_worker(worker, self.num_workers)
        with self.lock:
            return self.server.packed_backup(worker)

    def lower_exchange(self, worker: int, payload: Any, model_state: Any = None) -> jax.stages.Lowered:
        """The compiled exchange (push then pull) for ``worker``'s ``payload``, lowered, for inspection: what one push
        costs (``.compile().as_text()`` is its optimised HLO)."""
        _check_worker(worker, self.num_workers)
        packed = self.server.packed_payload(worker, payload, model_state)
        with self.lock:
            return self.server.lower(worker, *packed)

    def warm_up(self, checked: bool = False) -> None:
        """Compiles the exchange (and the backup lookup) now, on a scratch copy of the state, so the first push does
        not pay for compilation (hundreds of milliseconds; the trainer calls this before its clock starts).
        ``checked``: the exchange of :class:`~asgd_jax.trainer.messages.Checked` payloads (a run's asynchronous
        workers push theirs so), else the one that checks a payload itself (a round's mean, a caller's push)."""
        with self.lock:
            self.server.warm_up(checked)

    # -- the run's end and its files ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Stops taking pushes, settles the pushes in flight, writes the final checkpoint, closes the trace."""
        self.abort_rounds("the store was closed")
        self._closed.set()
        self.notify_version()
        self.applier.stop()
        # The final checkpoint: not of NaN weights, and not over a failed write (the one on disk is the last good).
        due = self.checkpoints.close()  # (a pending write that fails sets the error first)
        if due and not self.diverged and not isinstance(self.error, OSError) and not self.server.lost():
            try:
                self.save_checkpoint()
            except OSError as e:
                self.fail(OSError(f"writing the final checkpoint {self.checkpoints.path} failed: {e}"))
        if self.ledger.trace is not None:
            try:
                self.ledger.trace.close()
            except OSError as e:  # the last flush of a full disk
                self.fail(OSError(f"writing {self.ledger.trace.path} failed: {e}"))

    def save_checkpoint(self) -> str:
        """Writes a consistent checkpoint now (atomically); returns its path."""
        self.applier.settle()
        with self.lock:
            contents = self.checkpoint_contents()
        return self.checkpoints.save(contents)

    def state(self) -> server.ServerState:
        """A consistent snapshot of the whole server state (a host copy: the store updates its own in place)."""
        self.applier.settle()
        with self.lock:
            return host_copy(self.server.state)

    def final_weights(self) -> tuple[Any, Any]:
        """``(params, model_state)`` on the host at the end of a run: the server's, or, if a failing exchange consumed
        its donated state, the last weights it answered a push with."""
        with self.lock:
            if not self.server.lost():
                return host_copy(attrgetter("params", "model_state")(self.server.state))  # (one unpacking)
            return self.server.unpack(self.applier.last_answer)

    def status(self) -> StoreStatus:
        """The counts and how the store stands."""
        with self.lock:
            return self.ledger.status(self.closed, None if self.error is None else str(self.error), self._times)

    def take_snapshots(self) -> list[Snapshot]:
        """The snapshots of the weights taken since the last call (handed over)."""
        with self.lock:
            snapshots, self.applier.snapshots = self.applier.snapshots, []
        return snapshots

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def closed_reason(self) -> str:
        """Why the store takes no more pushes."""
        if self.error is not None:
            return f"the store stopped: {self.error}"
        return f"the store is closed after {self.applied} updates"

    def fail(self, error: BaseException) -> None:
        """Stops the store with ``error`` (the first error wins): nothing more is applied, workers are told why, the
        rounds are called off at once (without waiting for their lock: see :meth:`Rounds.abort_now`)."""
        log.error("the store stopped: %s", error)
        with self._error_lock:
            if self.error is None:
                self.error = error
        self._closed.set()
        self.notify_version()
        self.rounds.abort_now(f"the store stopped: {self.error}")

    # -- internals ----------------------------------------------------------------------------------------------------

    def checkpoint_contents(self) -> tuple:
        """What a checkpoint holds, as host copies: the state, each worker's data position, the header and books."""
        return host_copy(self.server.state), self.ledger.arrays(), {**self.header, **self.ledger.header()}

    def _restore(self, path: str) -> tuple[int, str | None]:
        """Restores a checkpoint (its header checked); the trace lines it pins."""
        state, arrays, header = checkpoint.load(path, self.server.state)
        check_header(path, header, self.header)
        self.server.restore(state)
        self.ledger.restore(header, arrays)
        log.info("resumed from %s at update %d", path, self.applied)
        return trace_pin(header)

    def _trace_failed(self, path: str, error: OSError) -> None:
        self.fail(OSError(f"writing {path} failed ({error}): free space and {self.checkpoints.way_on()}"))

    def end_of_budget(self) -> None:
        """The budget is reached: no more pushes are taken (those in flight are answered "closed")."""
        self._closed.set()

    def add_times(self, times: StoreTimes) -> None:
        """Adds ``times`` to the store's (:class:`StoreTimes`)."""
        with self._error_lock:
            self._times = self._times.plus(times)


def _check_worker(worker: int, num_workers: int) -> None:
    if not isinstance(worker, int | np.integer) or not 0 <= worker < num_workers:
        raise errors.ConfigError(f"worker={worker!r} is invalid: use an int in [0, {num_workers}).")
