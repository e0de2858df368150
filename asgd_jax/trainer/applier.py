"""The store's applier: one thread that applies the queued pushes one at a time, in arrival order.

Each push is either rejected (it came after the store closed; its payload held NaN/Inf), ignored (Ringmaster: computed
``threshold`` or more updates ago) or applied with the store's one exchange program, then written in the books and the
trace, checkpointed and snapshotted where due, and answered. Its time goes to :class:`~asgd_jax.trainer.messages.
StoreTimes`: the exchange program's (dispatch to answer on the host), the bookkeeping around it, and the idle wait for
a push (the workers, not the store, set the pace). A dead applier stops the run at once with its error, and every push
still queued is answered: nothing waits forever.
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
        self._thread = threading.Thread(target=self._loop, daemon=True, name="store-applier")
        self._thread.start()

    def put(self, item: tuple) -> None:
        """Queues ``(worker, payload, model_state, pulled_version, round_info, packed, future)``; after :meth:`stop`
        (a push that passed the store's closed check just before it closed) it is rejected as late at once."""
        with self._gate:
            if not self._stopped:
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
        store, item = self.store, None
        try:
            while True:
                t0 = time.perf_counter()
                if (item := self._queue.get()) is None:
                    break
                t1 = time.perf_counter()
                exchange_seconds = self._apply(*item)
                store.add_times(idle=t1 - t0, exchange=exchange_seconds, pushes=1)
                store.add_times(bookkeeping=time.perf_counter() - t1 - exchange_seconds)
        except BaseException as e:  # a dead applier stops the run at once, with its error
            store.fail(RuntimeError(f"the store's applier failed: {type(e).__name__}: {e}"))
            if item is not None and not item[-1].done():  # the push it died on is answered too
                with store.lock:
                    store.ledger.rejected += 1
                item[-1].set_exception(StoreClosed(store.closed_reason()))
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

    def _apply(self, worker, payload, model_state, pulled_version, round_info, packed, future: Future) -> float:
        """One push: rejected (late, non-finite), ignored, or applied with the server step, traced, and answered; the
        seconds its exchange program took (to its answer on the host)."""
        store = self.store
        budget_reached = store.num_updates is not None and store.applied >= store.num_updates
        if store.closed and (budget_reached or store.error is not None):
            with store.lock:
                store.ledger.late_push()
            future.set_exception(StoreClosed(store.closed_reason()))
            return 0.0
        if store.threshold is not None and store.applied - pulled_version >= store.threshold:
            with store.lock:  # Ringmaster: nothing applied; the worker pulls the current weights and goes on
                store.ledger.ignored_push(worker, pulled_version, uses_minibatch=True)
            future.set_result(store.pull(worker, packed=packed))
            return 0.0
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
