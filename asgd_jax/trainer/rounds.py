"""The store's rounds: SSGD's (every worker's payload, their mean applied once) and the gathered rounds of Rennala and
m-Synchronous SGD (``size`` payloads computed at the current weights make one update).

A round's mean is applied as one push of worker 0 through the store's own gate (the same server step, trace line and
checkpoint as an asynchronous push), under the rounds' lock: a worker that re-syncs and comes back while the mean is
being applied finds either the old round or the next one, never both. Every worker of a round waits on the same
condition for its end; a store that stops (:meth:`Rounds.abort_now`) wakes them all without waiting for that lock.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from asgd_jax import exchange
from asgd_jax.trainer.discipline import Gather
from asgd_jax.trainer.messages import BadPush, Ignored, StaleRound, StoreClosed

if TYPE_CHECKING:
    from asgd_jax.trainer.store import ParameterStore

__all__ = ["Rounds"]

log = logging.getLogger("asgd_jax.trainer.store")


class Rounds:
    """The rounds of ``store`` (``gather``: a round method's, or ``None`` for SSGD's)."""

    def __init__(self, store: ParameterStore, gather: Gather | None):
        self.store, self.gather = store, gather
        self._cv = threading.Condition()
        self._payloads: dict[int, tuple] = {}  # SSGD: this round's payloads by worker
        self._gathered: list[tuple] = []  # a round method's: (worker, payload, model state, skips before it)
        self._skips: dict[int, int] = {}  # per worker: gradients ignored since its last payload of a round
        self._inner: dict[int, Any] = {}  # this round's workers' inner-optimizer states (kept once it is applied)
        self._number = 0
        self._answer: tuple | BaseException | None = None  # the last round's (params, model_state, version)
        self.aborted: str | None = None

    def weights(self, *, packed: bool = False) -> tuple[Any, Any, int]:
        """Where every worker of a round computes: worker 0's backup (every round is its push), as host copies
        (``packed``: packed buffers), and its version."""
        params, model_state, version = self.store.packed_backup(0)
        return (*self.store.reply((params, model_state), packed), version)

    def push_round(
        self, worker: int, payload: Any, pulled_version: int, model_state: Any, timeout, packed: bool, inner: Any = None
    ):
        """SSGD: ``worker``'s payload for the round at ``pulled_version``; blocks until all M have sent theirs.

        The last to arrive applies the mean of the M payloads (in worker order) once, as worker 0, with the same
        server step as an asynchronous push; every worker gets the weights after it, ``(params, model_state,
        version)``. A non-finite mean is rejected (counted) and the round's answer is the unchanged weights. A worker
        that arrives twice in one round (restarted) replaces its payload. ``inner``: the worker's inner-optimizer
        state after its payload, kept with the round's update (:meth:`asgd_jax.trainer.ledger.Ledger.keep_inner`).

        Raises:
          StaleRound: the payload was computed at another version than the store's (re-sync from its backup).
          StoreClosed: the store closed, or :meth:`abort` called the rounds off.
          TimeoutError: the round did not complete within ``timeout`` seconds.
        """
        store = self.store
        with self._cv:
            self._check_open(gathered=False)
            if pulled_version != store.applied:
                raise StaleRound(f"computed at version {pulled_version}, the store is at {store.applied}")
            self._payloads[worker] = store.server.packed_payload(worker, payload, model_state, packed)
            self._keep(worker, inner)
            number = self._number
            if len(self._payloads) < store.num_workers:
                what = f"worker {worker}: the SSGD round at version {pulled_version}"
                return self._await(number, what, timeout, packed)
            entries = [self._payloads[w] for w in range(store.num_workers)]
            self._payloads = {}
            return self._finish(number, entries, pulled_version, timeout, packed)

    def push_gathered(
        self, worker: int, payload: Any, pulled_version: int, model_state: Any, timeout, packed: bool, inner: Any = None
    ):
        """A round method's payload computed at ``pulled_version``; returns the weights to go on at.

        A payload of the current round joins it; the ``size``-th makes the update (their mean, in arrival order for
        Rennala, in worker order for m-Synchronous, applied once as worker 0 with the round's workers and skips in
        the trace). Rennala: the worker goes on at once at the same weights (it may give another payload to the same
        round); m-Synchronous: it waits for the round's end. A payload of a round already past is a computation the
        round's end should have stopped: :class:`StaleRound` (discarded, its minibatches not used), or, for Rennala
        without stops, ignored (its minibatches used, the ignore traced) and answered with the current weights.

        Raises:
          StaleRound: the payload's round is past (restart at the current weights on the same minibatches).
          StoreClosed: the store closed, or :meth:`abort` called the rounds off.
          BadPush: a payload that does not fit the model.
          TimeoutError: an m-Synchronous round did not complete within ``timeout`` seconds.
        """
        store, g = self.store, self.gather
        assert g is not None  # (a round method's store)
        with self._cv:
            self._check_open(gathered=True)
            if pulled_version != store.applied:
                if g.kind == "rennala" and not g.stops:
                    with store.lock:  # ignored: counted and traced, its minibatch a skip of its next payload
                        store.ledger.received += 1
                        store.ledger.ignored_push(worker, pulled_version, uses_minibatch=False)
                    self._skips[worker] = self._skips.get(worker, 0) + 1
                    return self.weights(packed=packed)
                raise StaleRound(f"computed at version {pulled_version}, the store is at {store.applied}")
            payload, model_state = store.server.packed_payload(worker, payload, model_state, packed)
            self._gathered.append((worker, payload, model_state, self._skips.pop(worker, 0)))
            self._keep(worker, inner)
            number = self._number
            if len(self._gathered) < g.size:
                if g.kind == "rennala":
                    return self.weights(packed=packed)
                return self._await(number, f"worker {worker}: the round at version {pulled_version}", timeout, packed)
            entries = sorted(self._gathered, key=lambda e: e[0]) if g.kind == "msync" else self._gathered
            self._gathered = []
            info = (tuple(e[0] for e in entries), tuple(e[3] for e in entries))
            return self._finish(number, [e[1:3] for e in entries], pulled_version, timeout, packed, info)

    def _keep(self, worker: int, inner: Any) -> None:
        if inner is not None:
            self._inner[worker] = inner

    def _check_open(self, gathered: bool) -> None:
        if self.aborted is not None:
            raise StoreClosed(self.aborted)
        if gathered and self.store.closed:
            raise StoreClosed(self.store.closed_reason())

    def _await(self, number: int, what: str, timeout: float | None, packed: bool) -> tuple[Any, Any, int]:
        """Under the lock: waits for round ``number`` to be applied (or called off); its answer."""
        done = self._cv.wait_for(lambda: self._number != number or self.aborted is not None, timeout)
        if not done:
            raise TimeoutError(f"{what} did not complete")
        if self._number == number:
            raise StoreClosed(self.aborted)
        return self._reply(packed)

    def _finish(self, number: int, entries: list, pulled_version: int, timeout, packed: bool, info=None):
        """Under the lock: applies the mean of a round's payloads once, as worker 0 (a non-finite mean is rejected and
        the next round starts from the same weights), and answers every worker of the round."""
        store = self.store
        mean = exchange.host_mean([p for p, _ in entries])
        ms = exchange.host_mean([m for _, m in entries]) if store.server.stateful else ()
        inner, self._inner = self._inner, {}
        try:
            pushed = store.push(0, mean, pulled_version, ms, round_info=info, packed=True, inner=inner)
            answer: tuple | StoreClosed = pushed.result(timeout=timeout)
        except BadPush as e:
            log.warning("round at version %d: %s", pulled_version, e)
            answer = Ignored(*self.weights(packed=True))  # (nothing of the round applied)
        except StoreClosed as e:
            answer = e
        self._number, self._answer = number + 1, answer
        self._cv.notify_all()
        return self._reply(packed)

    def _reply(self, packed: bool) -> tuple[Any, Any, Any]:
        """The last round's answer, as this caller wants it (:class:`Ignored` for a rejected round's)."""
        if isinstance(self._answer, BaseException):
            raise self._answer
        assert self._answer is not None  # (read after a round ended)
        params, model_state, version = self._answer
        reply = (*self.store.reply((params, model_state), packed), version)
        return Ignored(*reply) if isinstance(self._answer, Ignored) else reply

    def abort(self, why: str) -> None:
        """Calls the rounds off: every worker waiting in one gets :class:`StoreClosed` saying ``why``."""
        with self._cv:
            if self.aborted is None:
                self.aborted = why
            self._cv.notify_all()

    def abort_now(self, why: str) -> None:
        """Calls the rounds off without waiting for their lock: the store stops the run while a worker holds that lock
        (a round's mean that diverged, a trace write on a full disk: usually the round's last worker, applying the
        mean itself, which may take the lock again: it is re-entrant), and waiting there for another thread was a
        deadlock until the run's timeout. Its waiters are woken by whoever holds the lock, or by a thread of their
        own."""
        if self.aborted is None:
            self.aborted = why  # read under the lock by its waiters
        if self._cv.acquire(blocking=False):
            try:
                self._cv.notify_all()
            finally:
                self._cv.release()
        else:
            threading.Thread(target=self.abort, args=(self.aborted,), daemon=True).start()
