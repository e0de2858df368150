"""The store's applier: the pushes applied one at a time, in arrival order, each by the thread that pushed it.

Each push is either rejected (it came after the store closed; its payload held NaN/Inf), ignored (Ringmaster: computed
``threshold`` or more updates ago) or applied with the store's one exchange program, then written in the books and the
trace, checkpointed and snapshotted where due, and answered. Its time goes to :class:`~asgd_jax.trainer.messages.
StoreTimes`: the exchange program's (dispatch to answer on the host), the bookkeeping around it, and the store's idle
time between the end of one push and the start of the next (the workers, not the store, set the pace). A failing apply
stops the run at once with its error, and every push after it is answered as late: nothing waits forever.

Pipelined (a plain asynchronous run in this process, ``store.pipelined``): the applier never waits for the device
before it answers. It dispatches a push's exchange and answers at once with the exchange's outputs as they lie on the
device (the worker's backup: the fresh weights, or for a rejected push the weights it computed at), so the worker's
next gradient is queued behind the exchange while the host is still busy; the push's flags are read, and the push
written in the books (:meth:`Applier.settle`), once the next push is dispatched too (two in flight: the device goes
from one to the next without waiting for the host's books), or before it where something is decided from the books
when they learn of the first (the budget's last update, a checkpoint, a snapshot), and before anyone reads the state
and the books together. A worker on the store's own device hands over its minibatches instead of a payload
(:class:`~asgd_jax.trainer.messages.Computed`): its period and the exchange run as one program. The order, the bits
and the books are those of the unpipelined store: a push is applied exactly once, in arrival order, and a rejected one
is counted, traced and leaves the state as it was; only the moment the books learn of it moves.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from asgd_jax.trainer.messages import BadPush, Computed, Ignored, Snapshot, StoreClosed, StoreTimes

if TYPE_CHECKING:
    from asgd_jax.trainer.state import Exchanged
    from asgd_jax.trainer.store import ParameterStore

__all__ = ["Applier"]


class Applier:
    """Applies ``store``'s pushes, one at a time, in arrival order, each on the thread that pushed it."""

    def __init__(self, store: ParameterStore):
        self.store = store
        self._gate = threading.Lock()  # one push applied at a time, in arrival order; none after stop()
        self._stopped = False
        self.snapshots: list[Snapshot] = []
        self.last_answer = store.server.answer(0)  # the final weights, should a failing exchange consume the state
        self._pending: collections.deque = collections.deque()  # pipelined: dispatched, flags not read yet (<= 2)
        self._settling = threading.Lock()
        self._idle_since: float | None = None  # the end of the last push: the store's wait for the next (not the first)

    def put(self, item: tuple) -> None:
        """Applies ``(worker, payload, model_state, pulled_version, round_info, packed, inner, future)`` (``inner``: the
        inner-optimizer states to keep once it is applied, by worker, or ``None``) on the pushing thread, under the
        gate, which orders the pushes as a queue would (the order they take it is their arrival order): applying one
        is too short a job to hand to another thread and back (a queue and an applier thread cost the ``cnn``'s store
        ~30% of a push, benchmarks/store_push.py). After :meth:`stop` (a push that passed the store's closed check
        just before it closed) it is rejected as late at once."""
        with self._gate:
            if not self._stopped:
                self._one(item, self._idle_since)
                return
        store = self.store
        with store.lock:
            store.ledger.late_push()
        item[-1].set_exception(StoreClosed(store.closed_reason()))

    def stop(self) -> None:
        """Takes no more pushes (the store is closed: any from now on are rejected as late) and settles the pipeline."""
        with self._gate:
            self._stopped = True
            try:
                self.settle()
            except BaseException as e:
                self._died(e, None)

    def _one(self, item: tuple, since: float | None) -> None:
        """Applies one push (the store idle since ``since``) and books its time; an exception stops the run (and an
        interrupt, having stopped it, goes on up)."""
        t1 = time.perf_counter()
        try:
            exchange_seconds = self._apply(*item)
        except BaseException as e:
            self._died(e, item)
            if not isinstance(e, Exception):
                raise
            return
        self._idle_since = time.perf_counter()
        bookkeeping, idle = self._idle_since - t1 - exchange_seconds, 0.0 if since is None else t1 - since
        self.store.add_times(StoreTimes(pushes=1, exchange=exchange_seconds, bookkeeping=bookkeeping, idle=idle))

    def _died(self, error: BaseException, item: tuple | None) -> None:
        """A failing apply stops the run at once, with its error; every push is in the books once (applied or
        rejected) and every one still unanswered is answered."""
        store = self.store
        dispatched = {id(entry[-1]) for entry in self._pending}  # (pipelined: in the books once settled)
        with contextlib.suppress(Exception):  # the pushes dispatched before the failing one ran: into the books
            self.settle()  # (the failing one, if it is among them, counted as rejected there)
        left = [entry[-1] for entry in self._pending]  # dispatched after it: their state is gone, so are they
        self._pending.clear()
        store.fail(RuntimeError(f"the store's applier failed: {type(error).__name__}: {error}"))
        unbooked = item is not None and id(item[-1]) not in dispatched and not item[-1].done()
        with store.lock:
            store.ledger.rejected += len(left) + unbooked
        for future in [*left, *([] if item is None else [item[-1]])]:
            if not future.done():
                future.set_exception(StoreClosed(store.closed_reason()))

    def _apply(self, worker, payload, model_state, pulled_version, round_info, packed, inner, future: Future) -> float:
        """One push: rejected (late, non-finite), ignored, or applied with the server step, traced, and answered; the
        seconds its exchange program took (to its answer on the host; pipelined: its dispatch and the waits for the
        device's outcome of the pushes settled on the way)."""
        store = self.store
        # The device's share: the push before it settled here (the books exact before anything is decided from them).
        waited = 0.0 if self._ahead() else self.settle()
        budget_reached = store.num_updates is not None and store.applied >= store.num_updates
        if store.closed and (budget_reached or store.error is not None):
            with store.lock:
                store.ledger.late_push()
            future.set_exception(StoreClosed(store.closed_reason()))
            return waited
        if store.threshold is not None and store.applied - pulled_version >= store.threshold:
            with store.lock:  # Ringmaster: nothing applied; the worker pulls the current weights and goes on
                store.ledger.ignored_push(worker, pulled_version, uses_minibatch=True)
            future.set_result(Ignored(*store.pull(worker, packed=packed)))
            return waited
        if store.pipelined:
            seconds = self._dispatch(worker, payload, model_state, round_info, packed, inner, future)
            return waited + seconds + self.settle(keep=1)  # (gone ahead: the push before it, while this one computes)
        with store.lock:
            t0 = time.perf_counter()
            out = store.server.exchange(worker, payload, model_state)
            seconds = time.perf_counter() - t0
            self._book(worker, pulled_version, out, round_info, inner)
            if out.ok:
                result = (*store.reply(out.answer, packed), store.applied)
        if not out.ok:  # NaN/Inf: the exchange left the state as it was
            future.set_exception(self._reject_nonfinite(worker, pulled_version, round_info))
            return seconds
        store.notify_version()
        future.set_result(result)
        return seconds

    def _ahead(self) -> bool:
        """Pipelined: whether this push may be dispatched before the one before it is in the books (which then come
        while it computes, the device never idle between them): only where nothing is decided from the books when
        they learn of the push before it (whether it is applied or not): not the budget's last update, a checkpoint or
        a snapshot, nor a store that closed."""
        store = self.store
        if not store.pipelined or not self._pending or store.closed:
            return False
        after = store.applied + 1  # (the push before it, applied)
        return (
            (store.num_updates is None or after < store.num_updates)
            and not store.checkpoints.due(after)
            and not self._snapshot_due(after)
        )

    def _snapshot_due(self, applied: int) -> bool:
        """Whether the weights after update ``applied`` are snapshotted for the evaluator."""
        every = self.store.snapshot_every
        return every is not None and every > 0 and applied % every == 0

    def _dispatch(self, worker, payload, model_state, round_info, packed, inner, future: Future) -> float:
        """Pipelined: dispatches the push's exchange (or, :class:`~asgd_jax.trainer.messages.Computed`, the worker's
        period with it) and answers at once with its outputs on the device; the seconds it took."""
        store = self.store
        with store.lock:
            t0 = time.perf_counter()
            if isinstance(payload, Computed):  # the worker's period and the exchange, one program
                dispatched, loss = store.server.dispatch_computed(worker, payload)
            else:
                dispatched, loss = store.server.dispatch(worker, payload, model_state), None
            self._pending.append((worker, round_info, inner, dispatched, future))
        answer = (*dispatched.answer, dispatched.version) if packed else self._unpacked(dispatched)
        future.set_result(answer if loss is None else (*answer, loss))
        return time.perf_counter() - t0

    def _unpacked(self, dispatched) -> tuple:
        params, model_state = self.store.server.unpack(dispatched.answer)  # (a caller of pytrees: waits here)
        return params, model_state, int(dispatched.version)

    def settle(self, keep: int = 0) -> float:
        """Pipelined: reads the flags of the pushes dispatched (waits for the device), all but the last ``keep``, in
        their order, and writes each in the books: applied (then checked for divergence, the budget, a checkpoint, a
        snapshot) or rejected. Idempotent; the applier calls it around each push and at its end, the store before it
        reads the state with the books. Returns the seconds it waited for the device (the exchanges' share of its
        time, and a computed push's period's: one program; the rest is bookkeeping)."""
        device = 0.0
        with self._settling:  # (one settler at a time: the books learn of the pushes in their order)
            while True:
                with self.store.lock:
                    if len(self._pending) <= keep:
                        return device
                    worker, round_info, inner, dispatched, _ = self._pending.popleft()
                    t0 = time.perf_counter()
                    try:
                        out = self.store.server.settle(dispatched)
                    except BaseException:  # its exchange failed on the device: counted, and the run stops
                        self.store.ledger.rejected += 1
                        raise
                    device += time.perf_counter() - t0
                    pulled_version = self.store.applied - out.staleness  # the store's own record
                    self._book(worker, pulled_version, out, round_info, inner)
                if out.ok:
                    self.store.notify_version()
                else:
                    self._reject_nonfinite(worker, pulled_version, round_info)  # counted; the worker went on

    def _book(self, worker: int, pulled_version: int, out: Exchanged, round_info: tuple | None, inner: Any) -> None:
        """Under the store's lock: an applied push (``out``: its exchange's outcome) into the books, then what follows
        an update (a rejected one is the caller's: it answers differently, settled or not)."""
        if out.ok:
            self.store.ledger.applied_push(worker, pulled_version, out.staleness, round_info)
            self.store.ledger.keep_inner(inner)
            self._after_update(out.sound, out.answer)

    def _after_update(self, sound: bool, answer: tuple) -> None:
        """Under the lock, after an applied update: divergence, the budget, a checkpoint, a snapshot."""
        store = self.store
        applied = store.applied
        self.last_answer = answer
        if not sound:
            store.diverged = True
            store.fail(
                FloatingPointError(
                    f"the weights turned NaN or Inf at update {applied}: the run diverged (lower the learning rate); "
                    f"{store.checkpoints.kept()}"
                )
            )
        elif store.num_updates is not None and applied >= store.num_updates:
            store.end_of_budget()
        if store.checkpoints.due(applied) and not store.diverged:
            # (an OSError: the trace's lines could not be written out; the store stopped, the last checkpoint stays)
            with contextlib.suppress(OSError):
                store.checkpoints.submit(store.checkpoint_contents())
        if self._snapshot_due(applied):
            # The server's weights (a pull-side rule sends a look-ahead instead: that is not what is evaluated).
            weights = store.server.weights() if store.server.sends else answer
            self.snapshots.append(Snapshot(applied, *store.server.unpack(weights), taken=time.time()))

    def _reject_nonfinite(self, worker: int, pulled_version: int, round_info: tuple | None) -> BadPush:
        """Counts a NaN/Inf push (its minibatches used up, traced) and stops the store on policy or after a streak."""
        store = self.store
        with store.lock:
            streak = store.ledger.rejected_push(worker, pulled_version, round_info)
        message = f"push from worker {worker} (pulled at version {pulled_version}) holds NaN or Inf"
        if store.on_nonfinite == "stop":
            store.fail(BadPush(message + "; stopping (on_nonfinite='stop')"))
        elif streak >= store.max_nonfinite:
            store.fail(
                BadPush(
                    f"{streak} pushes in a row held NaN or Inf: the run diverged (lower the learning rate, check the "
                    f"data); stopped after max_nonfinite={store.max_nonfinite} (--max-nonfinite)"
                )
            )
        return BadPush(message)
