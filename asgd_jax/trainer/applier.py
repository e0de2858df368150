"""The store's applier: one thread that applies the queued pushes one at a time, in arrival order.

Each push is either rejected (it came after the store closed; its payload held NaN/Inf), ignored (Ringmaster: computed
``threshold`` or more updates ago) or applied with the store's one exchange program, then written in the books and the
trace, checkpointed and snapshotted where due, and answered. Its time goes to :class:`~asgd_jax.trainer.messages.
StoreTimes`: the exchange program's (dispatch to answer on the host), the bookkeeping around it, and the idle wait for
a push (the workers, not the store, set the pace). A dead applier stops the run at once with its error, and every push
still queued is answered: nothing waits forever.

Pipelined (a plain asynchronous run in this process, ``store.pipelined``): the applier never waits for the device
before it answers. It dispatches a push's exchange and answers at once with the exchange's outputs as they lie on the
device (the worker's backup: the fresh weights, or for a rejected push the weights it computed at), so the worker's
next gradient is queued behind the exchange while the host is still busy; the push's flags are read, and the push
written in the books, when the next one arrives (:meth:`Applier.settle`), before anything is decided from the books
(the budget, a checkpoint, a snapshot, divergence) and before anyone reads the state and the books together. The
order, the bits and the books are those of the unpipelined store: a push is applied exactly once, in arrival order,
and a rejected one is counted, traced and leaves the state as it was; only the moment the books learn of it moves.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

from asgd_jax.trainer.messages import BadPush, Snapshot, StoreClosed

if TYPE_CHECKING:
    from asgd_jax.trainer.store import ParameterStore

__all__ = ["Applier"]


class Applier:
    """The applier thread of ``store`` (started at once)."""

    def __init__(self, store: ParameterStore):
        self.store = store
        self._queue: queue.Queue = queue.Queue()
        self._gate = threading.Lock()  # a push queued after stop() is answered at once, never left in the queue
        self._stopped = False
        self.snapshots: list[Snapshot] = []
        self.last_answer = store.server.answer(0)  # the final weights, should a failing exchange consume the state
        self._pending: tuple | None = None  # pipelined: the dispatched push whose flags are not read yet
        self._thread = threading.Thread(target=self._loop, daemon=True, name="store-applier")
        self._thread.start()

    def put(self, item: tuple) -> None:
        """Queues ``(worker, payload, model_state, pulled_version, round_info, packed, future)``; after :meth:`stop`
        (a push that passed the store's closed check just before it closed) it is rejected as late at once.

        Pipelined, the pushing thread applies its push itself, under the gate (which orders the pushes as a queue
        would: the order they take it is their arrival order): dispatching an exchange is too short a job to hand
        to another thread and back.
        """
        with self._gate:
            if not self._stopped:
                if self.store.pipelined:
                    self._one(item, time.perf_counter())
                else:
                    self._queue.put(item)
                return
        store = self.store
        with store.lock:
            store.ledger.late_push()
        item[-1].set_exception(StoreClosed(store.closed_reason()))

    def stop(self, timeout: float = 60) -> None:
        """Lets the applier finish the queue (the store is closed: those pushes are rejected as late) and end."""
        with self._gate:
            self._stopped = True
            self._queue.put(None)
        self._thread.join(timeout=timeout)

    def _loop(self) -> None:
        store = self.store
        while not store.error:
            t0 = time.perf_counter()
            if (item := self._queue.get()) is None:
                try:
                    self.settle()
                except BaseException as e:
                    self._died(e, None)
                break
            self._one(item, t0)
        # Anything still queued after close is rejected, so pushes sent == applied + rejected; anything put from now
        # on is rejected by put() itself (the applier may have died: nothing would take it from the queue).
        with self._gate:
            self._stopped = True
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                with store.lock:
                    store.ledger.late_push()
                item[-1].set_exception(StoreClosed(store.closed_reason()))

    def _one(self, item: tuple, since: float) -> None:
        """Applies one push (waited for since ``since``) and books its time; an exception stops the run."""
        t1 = time.perf_counter()
        try:
            exchange_seconds = self._apply(*item)
        except BaseException as e:
            self._died(e, item)
            return
        self.store.add_times(idle=t1 - since, exchange=exchange_seconds, pushes=1)
        self.store.add_times(bookkeeping=time.perf_counter() - t1 - exchange_seconds)

    def _died(self, error: BaseException, item: tuple | None) -> None:
        """A failing apply stops the run at once, with its error; the push it died on is answered too."""
        store = self.store
        self._pending = None  # (the flags of a dispatched push could not be read: it is not in the books)
        store.fail(RuntimeError(f"the store's applier failed: {type(error).__name__}: {error}"))
        if item is not None and not item[-1].done():
            with store.lock:
                store.ledger.rejected += 1
            item[-1].set_exception(StoreClosed(store.closed_reason()))

    def _apply(self, worker, payload, model_state, pulled_version, round_info, packed, future: Future) -> float:
        """One push: rejected (late, non-finite), ignored, or applied with the server step, traced, and answered; the
        seconds its exchange program took (to its answer on the host)."""
        store = self.store
        t0 = time.perf_counter()
        self.settle()  # the push before it: the books are exact before anything is decided from them
        waited = time.perf_counter() - t0
        budget_reached = store.num_updates is not None and store.applied >= store.num_updates
        if store.closed and (budget_reached or store.error is not None):
            with store.lock:
                store.ledger.late_push()
            future.set_exception(StoreClosed(store.closed_reason()))
            return waited
        if store.threshold is not None and store.applied - pulled_version >= store.threshold:
            with store.lock:  # Ringmaster: nothing applied; the worker pulls the current weights and goes on
                store.ledger.ignored_push(worker, pulled_version, uses_minibatch=True)
            future.set_result(store.pull(worker, packed=packed))
            return waited
        if store.pipelined:
            with store.lock:
                t0 = time.perf_counter()
                dispatched = store.server.dispatch(worker, payload, model_state)
                self._pending = (worker, round_info, dispatched)
            future.set_result((*dispatched.answer, dispatched.version) if packed else self._unpacked(dispatched))
            return waited + time.perf_counter() - t0
        with store.lock:
            t0 = time.perf_counter()
            out = store.server.exchange(worker, payload, model_state)
            seconds = time.perf_counter() - t0
            if out.ok:
                store.ledger.applied_push(worker, pulled_version, out.staleness, round_info)
                self._after_update(out.sound, out.answer)
                result = (*store.reply(out.answer, packed), store.applied)
        if not out.ok:  # NaN/Inf: the exchange left the state as it was
            future.set_exception(self._reject_nonfinite(worker, pulled_version, round_info))
            return seconds
        store.notify_version()
        future.set_result(result)
        return seconds

    def _unpacked(self, dispatched) -> tuple:
        params, model_state = self.store.server.unpack(dispatched.answer)  # (a caller of pytrees: waits here)
        return params, model_state, int(dispatched.version)

    def settle(self) -> None:
        """Pipelined: reads the flags of the push dispatched last (waits for the device) and writes it in the books:
        applied (then checked for divergence, the budget, a checkpoint, a snapshot) or rejected. Idempotent; the
        applier calls it before each push and at its end, the store before it reads the state with the books."""
        with self.store.lock:
            if self._pending is None:
                return
            worker, round_info, dispatched = self._pending
            self._pending = None
            out = self.store.server.settle(dispatched)
            pulled_version = self.store.applied - out.staleness  # the store's own record (the worker's is a future)
            if out.ok:
                self.store.ledger.applied_push(worker, pulled_version, out.staleness, round_info)
                self._after_update(out.sound, out.answer)
        if out.ok:
            self.store.notify_version()
        else:
            self._reject_nonfinite(worker, pulled_version, round_info)  # counted; the worker went on at its backup

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
            store.checkpoints.submit(store.checkpoint_contents())
        if store.snapshot_every and applied % store.snapshot_every == 0:
            # The server's weights (a pull-side rule sends a look-ahead instead: that is not what is evaluated).
            weights = store.server.weights() if store.server.sends else answer
            self.snapshots.append(Snapshot(applied, *store.server.unpack(weights)))

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
