"""The host-side parameter store: the simulator's server step, applied to pushes from real worker threads.

Workers ``pull`` the weights once and then ``push`` payloads; one applier thread applies the pushes one at a time, in
arrival order, with the same pure :func:`asgd_jax.server.push` the simulator scans, and right after applying a push
records that worker's pull (:func:`asgd_jax.server.pull`) and hands it the fresh weights. That push-then-pull is
atomic, which is exactly the simulator's semantics, so the recorded trace (``trace.jsonl``: one line per applied push)
replays in the simulator as ``asgd_jax.delays.Trace.load(path)`` (the format is :mod:`asgd_jax.trace`'s).

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
:class:`asgd_jax.worker.Answer`, and where a driver polls the run's :class:`StoreStatus`, the losses pushed since its
last poll and the snapshots of the weights to evaluate.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from asgd_jax import checkpoint, delays, errors, exchange, packing, server, session, trace
from asgd_jax.worker import Answer, Sync, Weights

__all__ = [
    "BadPush",
    "Endpoint",
    "Gather",
    "ParameterStore",
    "Progress",
    "Snapshot",
    "StaleRound",
    "StoreClosed",
    "StoreStatus",
    "StoreTimes",
    "check_resume",
    "for_run",
    "trace_pin",
]


log = logging.getLogger("asgd_jax.store")

CHECKPOINT = session.CHECKPOINT


class StoreTimes(NamedTuple):
    """Where the store's time went this session, in seconds (``summary.json``'s ``"store"``).

    Attributes:
      pushes: pushes its applier handled (applied, rejected as NaN/Inf, ignored as too stale, late).
      exchange: its exchange programs, from dispatch to the answer on the host (the device's share).
      bookkeeping: the rest of a push on the applier: counts, the trace line, a checkpoint handed to its writer,
        snapshots, the answer handed back.
      idle: the applier waiting for a push (the workers, not the store, set the pace).
      transfer_in: the pushing threads moving payloads to the store's device (overlapping the applier's work).
    """

    pushes: int = 0
    exchange: float = 0.0
    bookkeeping: float = 0.0
    idle: float = 0.0
    transfer_in: float = 0.0


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
    """Host copies of the server's weights right after update ``version`` (to evaluate)."""

    version: int
    params: Any
    model_state: Any


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


class Gather(NamedTuple):
    """A round method's rounds in the store: ``size`` payloads computed at the current weights make one update.

    ``kind``: ``"rennala"`` (Rennala SGD: a worker may give several, averaged in arrival order; a gradient computed at
    an older iterate is ignored, its minibatch used, unless ``stops``) or ``"msync"`` (m-Synchronous SGD: one per
    worker, averaged in worker order; the other computations are stopped at the round's end)."""

    kind: str
    size: int
    stops: bool

    @classmethod
    def of(cls, model: Any) -> Gather | None:
        """The rounds of a delay model (:class:`asgd_jax.delays.Rennala`, :class:`asgd_jax.delays.MSync`), or None."""
        if isinstance(model, delays.Rennala):
            return cls("rennala", model.batch, model.stops)
        if isinstance(model, delays.MSync):
            return cls("msync", model.m, True)
        return None


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
      threshold: Ringmaster ASGD's R (``asgd_jax.delays.Ringmaster``): a push computed ``threshold`` or more updates
        ago is ignored (its minibatches used up, nothing applied, the version not advanced, the trace says
        ``"ignored"``) and answered with the current weights, which become the worker's backup. ``None``: none is.
      gather: a round method's rounds (:class:`Gather`, :meth:`push_gathered`), or ``None``.

    The settings are the trainer's, checked once in :class:`asgd_jax.TrainConfig` and its plan.

    Nothing fails silently: a failing trace or checkpoint write (a full disk), an exception in the applier, or
    weights that turn NaN/Inf close the store with :attr:`error` set, and the workers' next push raises
    :class:`StoreClosed` saying why. The last checkpoint on disk stays the last good one.
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
    ):
        errors.positive_int("num_workers", num_workers)
        self.threshold = None if threshold is None else errors.positive_int("threshold", threshold)
        # Consecutive non-finite pushes that stop the run: a diverged model pushes nothing else, forever.
        self.max_nonfinite = max_nonfinite or 10 * num_workers
        self._nonfinite_streak = 0
        self.diverged = False  # the weights turned NaN/Inf: no checkpoint of them is written
        self.device = device or jax.devices("cpu")[0]
        self.num_workers, self.num_updates, self.on_nonfinite = num_workers, num_updates, on_nonfinite
        with jax.default_device(self.device):
            params, model_state = jax.device_put((params, model_state), self.device)  # explicit, never implicit
            state = jax.jit(lambda p, ms: server.init(rule, p, num_workers, ms))(params, model_state)
        self._state = jax.device_put(state, self.device)
        self._ids = [jax.device_put(np.int32(w), self.device) for w in range(num_workers)]  # placed once, not per push
        self.received = self.applied = self.rejected = self.ignored = 0
        self.late = 0  # of the rejected: pushes that arrived after the store closed (the budget was reached)
        self.positions = np.zeros(num_workers, np.int64)  # per worker: pushes applied or rejected as non-finite
        self.staleness_counts: collections.Counter[int] = collections.Counter()
        self._times = StoreTimes()
        self.header = {"num_workers": num_workers, **(header or {})}
        self.checkpoint_path = None if checkpoint_dir is None else os.path.join(os.fspath(checkpoint_dir), CHECKPOINT)
        self.checkpoint_every, self.resumed_from = checkpoint_every, 0
        self._trace_pin: tuple[int, str | None] = (0, None)  # a resume: the trace's lines and digest to keep
        if self.checkpoint_path is not None and os.path.exists(self.checkpoint_path):
            if not resume:
                raise errors.ConfigError(
                    f"{checkpoint_dir} already holds a checkpoint ({self.checkpoint_path}): pass resume=True "
                    "(--resume) to continue that run, or choose another output folder."
                )
            self._restore(self.checkpoint_path)
        self._stateful = model_state is not None
        # Pushes and answers cross as packed buffers (one per dtype), whatever the leaf count (asgd_jax.packing).
        self.layout = packing.Layout.of(state.params)
        self.model_state_layout = packing.Layout.of(state.model_state if self._stateful else {})
        self._structure = jax.tree.structure(state.params)
        self._leaves = [(x.shape, x.dtype) for x in jax.tree.leaves(state.params)]
        self._compile(rule)
        self._last_answer = self._host(self._answer_program(self._state, self._id(0)))
        self._lock = threading.Lock()
        # SSGD rounds: this round's payloads by worker, the round's number and answer, and why rounds were called off.
        self._round: dict[int, tuple] = {}
        self._round_no, self._round_answer, self._round_abort = 0, None, None
        self._round_cv = threading.Condition()
        self._error_lock = threading.Lock()
        self.gather = gather
        self._gathered: list[tuple] = []  # this round's payloads: (worker, payload, model state, skips before it)
        self._gather_skips: dict[int, int] = {}  # per worker: gradients ignored since its last payload of a round
        self._version_cv = threading.Condition()  # notified at every applied update and at close
        self._queue: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        self.error: BaseException | None = None
        self.snapshot_every, self._snapshots = snapshot_every, []
        self._trace = None
        self._t0 = time.perf_counter()
        if out_dir is not None:
            os.makedirs(out_dir, exist_ok=True)
            self._trace = trace.Writer(os.path.join(out_dir, trace.FILE), *self._trace_pin)
        self._writer = None
        if self.checkpoint_path is not None:
            self._writer = checkpoint.Writer(self.checkpoint_path, self.fail)
        self._applier = threading.Thread(target=self._apply_loop, daemon=True, name="store-applier")
        self._applier.start()

    def _compile(self, rule: optax.GradientTransformation) -> None:
        """The very same server step the simulator scans, jitted for the store's device, on packed pushes.

        One program per push: the payload's leaves are slices of its packed buffers, the finite check is an output
        (a payload with NaN/Inf leaves the state as it was, under ``lax.cond``), and so are the staleness and the
        answer: what the worker computes at next, packed, with its own finite check (weights that turned NaN/Inf).
        The state is donated: the server updates weights, rule state and the M backups in place instead of copying
        (M + 2) x params per push (benchmarks/trainer_overhead.py, store_push.py).
        """
        layout, ms_layout, stateful = self.layout, self.model_state_layout, self._stateful

        def answer(s, w):  # what a pull by w sends (a pull-side rule's look-ahead is its backup), packed
            params, model_state = server.snapshot(s, w) if server.has_pull(rule) else (s.params, s.model_state)
            return layout.pack(params), ms_layout.pack(model_state if stateful else {})

        def exchange_packed(s, w, g, ms):
            ok = _finite_packed((*g, *ms))
            grads, model_state = layout.unpack(g), ms_layout.unpack(ms) if stateful else None
            # Applied at most once: a loop of ok (0 or 1) trips keeps the per-worker stacks updated in place, where
            # lax.cond made XLA copy them on every push (tests/test_store.py pins it on the compiled HLO).
            s, staleness, _ = jax.lax.while_loop(
                lambda c: c[2] < ok.astype(jnp.int32),
                lambda c: (*server.exchange(rule, c[0], w, grads, model_state), c[2] + 1),
                (s, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)),
            )
            sent = answer(s, w)
            return s, staleness, ok, _finite_packed(sent[0]), sent

        self._exchange = jax.jit(exchange_packed, donate_argnums=0)
        self._pull = jax.jit(lambda s, w: server.pull(s, w, rule=rule))
        self._answer_program = jax.jit(answer)
        self._sends = server.has_pull(rule)
        self._backup = jax.jit(lambda s, i: (*server.snapshot(s, i), server.snapshot_version(s, i)))
        self._packed_backup = jax.jit(
            lambda s, i: (
                layout.pack(server.snapshot(s, i)[0]),
                ms_layout.pack(server.snapshot(s, i)[1] if stateful else {}),
                server.snapshot_version(s, i),
            )
        )
        self._weights = jax.jit(lambda s: (layout.pack(s.params), ms_layout.pack(s.model_state if stateful else {})))

    def _host(self, packed: tuple) -> tuple:
        """Packed device buffers as host arrays: zero-copy views on a CPU (the answer is a fresh buffer of its own,
        never donated), one transfer per buffer from an accelerator."""
        return jax.tree.map(np.asarray, jax.device_get(packed))

    def unpack(self, packed: tuple) -> tuple[Any, Any]:
        """Packed ``(params, model_state)`` host buffers as the model's pytrees (views, no copy)."""
        params, model_state = packed
        return self.layout.unpack_host(params), self.model_state_layout.unpack_host(
            model_state
        ) if self._stateful else None

    def _packed_payload(
        self, worker: int, payload: Any, model_state: Any, packed: bool | None = None
    ) -> tuple[tuple, tuple]:
        """A push's payload and model state as packed host buffers: given packed (a worker's), or packed here from
        the model's pytrees (``packed=None``: whichever it is). A misfit is a :class:`BadPush` naming the leaf or
        buffer."""
        if packed is None:
            packed = self.layout.misfit(payload) is None
        problem = self.layout.misfit(payload) if packed else self._misfit(payload)
        if problem:
            raise BadPush(f"push from worker {worker} rejected: {problem}")
        if not packed:
            payload = self.layout.pack_host(payload)
        if not self._stateful:
            return payload, ()
        if self.model_state_layout.misfit(model_state) is not None:
            model_state = self.model_state_layout.pack_host(model_state)
        return payload, model_state

    # -- the worker-facing API ----------------------------------------------------------------------------------------

    def pull(self, worker: int, *, packed: bool = False) -> tuple[Any, Any, int]:
        """Records ``worker``'s backup; returns ``(params, model_state, version)``: the weights it computes at (host
        arrays; ``packed``: as packed buffers, :attr:`layout`'s)."""
        self._check_worker(worker)
        with self._lock:
            self._state = self._pull(self._state, self._id(worker))
            answer = self._host(self._answer_program(self._state, self._id(worker)))
            return (*self._reply(answer, packed), self.applied)

    def _reply(self, answer: tuple, packed: bool) -> tuple[Any, Any]:
        """A packed answer as its caller wants it: packed, or as the model's pytrees (views)."""
        return answer if packed else self.unpack(answer)

    def push(
        self,
        worker: int,
        payload: Any,
        pulled_version: int,
        model_state: Any = None,
        round_info: tuple | None = None,
        *,
        packed: bool = False,
    ) -> Future:
        """Queues a payload computed at the weights of ``pulled_version``.

        The payload is the model's pytree or its packed buffers (:attr:`layout`, what a worker sends); it is moved to
        the store's device here, on the pushing thread, while the applier applies the pushes queued before it.

        Returns:
          A future resolving to ``(params, model_state, version)``: the weights right after this push was applied,
          already recorded as this worker's backup (its next pull), as pytrees (``packed``: packed buffers). It raises
          :class:`BadPush` for a rejected non-finite payload and :class:`StoreClosed` once the store stopped.

        Raises:
          BadPush: at once, for a payload whose structure, shapes or dtypes do not fit the model.
          StoreClosed: when the store no longer takes pushes.
        """
        self._check_worker(worker)
        with self._lock:
            self.received += 1
            if self._closed.is_set():
                self.rejected += 1
                self.late += 1
                raise StoreClosed(self._closed_reason())
        try:
            g, ms = self._packed_payload(worker, payload, model_state, packed)
        except BadPush:
            with self._lock:
                self.rejected += 1
            raise
        t0 = time.perf_counter()
        g, ms = jax.device_put((g, ms), self.device)  # explicit; overlaps the apply of the pushes ahead of it
        self._time(transfer_in=time.perf_counter() - t0)
        future: Future = Future()
        self._queue.put((worker, g, ms, pulled_version, round_info, packed, future))
        return future

    def wait_version(self, version: int, timeout: float) -> int:
        """Waits up to ``timeout`` seconds for the store to reach ``version`` applied updates (or to close); returns
        the applied updates then (a worker's computation that has become too stale to use is stopped on it)."""
        with self._version_cv:
            self._version_cv.wait_for(lambda: self.applied >= version or self._closed.is_set(), timeout)
            return self.applied

    def _notify_version(self) -> None:
        with self._version_cv:
            self._version_cv.notify_all()

    def backup(self, worker: int) -> tuple[Any, Any, int]:
        """``worker``'s backup: the weights, model state and version it last pulled (w_0 and 0 before any pull)."""
        self._check_worker(worker)
        with self._lock:
            params, model_state, version = self._backup(self._state, self._id(worker))
        return params, model_state, int(jax.device_get(version))

    def push_round(
        self,
        worker: int,
        payload: Any,
        pulled_version: int,
        model_state: Any = None,
        timeout: float | None = None,
        *,
        packed: bool = False,
    ) -> tuple[Any, Any, int]:
        """SSGD: ``worker``'s payload for the round at ``pulled_version``; blocks until all M have sent theirs.

        The last to arrive applies the mean of the M payloads (in worker order) once, as worker 0, with the same
        server step as an asynchronous push; every worker gets the weights after it, ``(params, model_state,
        version)``. A non-finite mean is rejected (counted) and the round's answer is the unchanged weights. A worker
        that arrives twice in one round (restarted) replaces its payload.

        Raises:
          StaleRound: the payload was computed at another version than the store's (re-sync from :meth:`backup`).
          StoreClosed: the store closed, or :meth:`abort_rounds` called the rounds off.
          TimeoutError: the round did not complete within ``timeout`` seconds.
        """
        self._check_worker(worker)
        # The whole round, its application included, happens under the round's lock: a worker that re-syncs and
        # comes back while the mean is being applied must find either the old round or the next one, never both.
        with self._round_cv:
            if self._round_abort is not None:
                raise StoreClosed(self._round_abort)
            if pulled_version != self.applied:
                raise StaleRound(f"computed at version {pulled_version}, the store is at {self.applied}")
            self._round[worker] = self._packed_payload(worker, payload, model_state, packed)
            number = self._round_no
            if len(self._round) < self.num_workers:
                return self._await_round(
                    number, f"worker {worker}: the SSGD round at version {pulled_version}", timeout, packed
                )
            payloads = [self._round[w] for w in range(self.num_workers)]
            self._round = {}
            return self._finish_round(
                number, [p for p, _ in payloads], [m for _, m in payloads], pulled_version, timeout, packed
            )

    def push_gathered(
        self,
        worker: int,
        payload: Any,
        pulled_version: int,
        model_state: Any = None,
        timeout: float | None = None,
        *,
        packed: bool = False,
    ) -> tuple[Any, Any, int]:
        """A round method's payload (:class:`Gather`) computed at ``pulled_version``; returns the weights to go on at.

        A payload of the current round joins it; the ``size``-th makes the update (their mean, in arrival order for
        Rennala, in worker order for m-Synchronous, applied once as worker 0 with the round's workers and skips in
        the trace). Rennala: the worker goes on at once at the same weights (it may give another payload to the same
        round); m-Synchronous: it waits for the round's end. A payload of a round already past is a computation the
        round's end should have stopped: :class:`StaleRound` (discarded, its minibatches not used), or, for Rennala
        without stops, ignored (its minibatches used, the ignore traced) and answered with the current weights.

        Raises:
          StaleRound: the payload's round is past (restart at the current weights on the same minibatches).
          StoreClosed: the store closed, or :meth:`abort_rounds` called the rounds off.
          BadPush: a payload that does not fit the model.
          TimeoutError: an m-Synchronous round did not complete within ``timeout`` seconds.
        """
        self._check_worker(worker)
        g = self.gather
        with self._round_cv:
            if self._round_abort is not None:
                raise StoreClosed(self._round_abort)
            if self._closed.is_set():
                raise StoreClosed(self._closed_reason())
            if pulled_version != self.applied:
                if g.kind == "rennala" and not g.stops:
                    return self._ignore_gathered(worker, pulled_version, packed)
                raise StaleRound(f"computed at version {pulled_version}, the store is at {self.applied}")
            payload, model_state = self._packed_payload(worker, payload, model_state, packed)
            self._gathered.append((worker, payload, model_state, self._gather_skips.pop(worker, 0)))
            number = self._round_no
            if len(self._gathered) < g.size:
                if g.kind == "rennala":
                    return self.round_weights(packed=packed)
                what = f"worker {worker}: the round at version {pulled_version}"
                return self._await_round(number, what, timeout, packed)
            entries = sorted(self._gathered, key=lambda e: e[0]) if g.kind == "msync" else self._gathered
            self._gathered = []
            info = (tuple(e[0] for e in entries), tuple(e[3] for e in entries))
            payloads, states = [e[1] for e in entries], [e[2] for e in entries]
            return self._finish_round(number, payloads, states, pulled_version, timeout, packed, info)

    def _await_round(self, number: int, what: str, timeout: float | None, packed: bool) -> tuple[Any, Any, int]:
        """Under the round's lock: waits for round ``number`` to be applied (or called off); its answer."""
        done = self._round_cv.wait_for(lambda: self._round_no != number or self._round_abort is not None, timeout)
        if not done:
            raise TimeoutError(f"{what} did not complete")
        if self._round_no == number:
            raise StoreClosed(self._round_abort)
        return self._answer(packed)

    def _finish_round(
        self,
        number: int,
        payloads: list,
        states: list,
        pulled_version: int,
        timeout,
        packed: bool,
        info: tuple | None = None,
    ) -> tuple[Any, Any, int]:
        """Under the round's lock: applies the mean of a round's payloads once, as worker 0 (a non-finite mean is
        rejected and the next round starts from the same weights), and answers every worker of the round."""
        mean = exchange.host_mean(payloads)
        ms = exchange.host_mean(states) if self._stateful else ()
        try:
            answer: Any = self.push(0, mean, pulled_version, ms, round_info=info, packed=True).result(timeout=timeout)
        except BadPush as e:
            log.warning("round at version %d: %s", pulled_version, e)
            answer = self.round_weights(packed=True)
        except StoreClosed as e:
            answer = e
        self._round_no, self._round_answer = number + 1, answer
        self._round_cv.notify_all()
        return self._answer(packed)

    def _ignore_gathered(self, worker: int, pulled_version: int, packed: bool) -> tuple[Any, Any, int]:
        """Rennala without stops: a gradient computed at an older iterate is ignored (its minibatch used: a skip
        before that worker's next payload) and its worker goes on at the current weights."""
        with self._lock:
            self.received += 1
            self.ignored += 1
            self._write_trace(worker, pulled_version, self.applied - pulled_version, ignored=True)
        self._gather_skips[worker] = self._gather_skips.get(worker, 0) + 1
        return self.round_weights(packed=packed)

    def round_weights(self, *, packed: bool = False) -> tuple[Any, Any, int]:
        """Where every worker of a round computes: worker 0's backup (every round is its push), as host copies
        (``packed``: packed buffers), and its version."""
        params, model_state, version = self.packed_backup(0)
        return (*self._reply((params, model_state), packed), version)

    def packed_backup(self, worker: int) -> tuple[tuple, tuple, int]:
        """``worker``'s backup as packed host buffers (one program, one transfer per buffer) and its version."""
        self._check_worker(worker)
        with self._lock:
            params, model_state, version = self._packed_backup(self._state, self._id(worker))
        params, model_state = self._host((params, model_state))
        return params, model_state, int(jax.device_get(version))

    def pack_model_state(self, model_state: Any) -> tuple:
        """A model state as packed host buffers (``()`` for a model without one)."""
        return self.model_state_layout.pack_host(model_state) if self._stateful else ()

    def _answer(self, packed: bool) -> tuple[Any, Any, int]:
        """The last round's answer, as this caller wants it."""
        if isinstance(self._round_answer, BaseException):
            raise self._round_answer
        params, model_state, version = self._round_answer
        return (*self._reply((params, model_state), packed), version)

    def abort_rounds(self, why: str) -> None:
        """Calls the SSGD rounds off (a worker died): every worker waiting in :meth:`push_round` gets StoreClosed."""
        with self._round_cv:
            if self._round_abort is None:
                self._round_abort = why
            self._round_cv.notify_all()

    def lower_exchange(self, worker: int, payload: Any, model_state: Any = None) -> jax.stages.Lowered:
        """The compiled exchange (push then pull) for ``worker``'s ``payload``, lowered, for inspection: what one push
        costs (``.compile().as_text()`` is its optimised HLO)."""
        self._check_worker(worker)
        g, ms = jax.device_put(self._packed_payload(worker, payload, model_state), self.device)
        with self._lock:
            return self._exchange.lower(self._state, self._id(worker), g, ms)

    def warm_up(self) -> None:
        """Compiles the exchange (and the backup lookup) now, on a scratch copy of the state, so the first push does
        not pay for compilation (hundreds of milliseconds; the trainer calls this before its clock starts)."""
        with self._lock:
            # A scratch copy (donated below; the live state is untouched) and a zero payload, made on the device.
            scratch = jax.jit(lambda st: jax.tree.map(jnp.copy, st))(self._state)
            g, ms = jax.device_put(self._zeros, self.device)
            jax.block_until_ready(self._exchange(scratch, self._id(0), g, ms))
            jax.block_until_ready(self._backup(self._state, self._id(0)))
            jax.block_until_ready(self._weights(self._state))

    def close(self) -> None:
        """Stops taking pushes, lets the applier finish the queue, writes the final checkpoint, closes the trace."""
        self.abort_rounds("the store was closed")
        if self._applier.is_alive():
            self._closed.set()
            self._notify_version()
            self._queue.put(None)
            self._applier.join(timeout=60)
        if self._writer is not None:
            self._writer.close()
            # The final checkpoint: not of NaN weights, and not over a failed write (the one on disk is the last good).
            sound = not self.diverged and not isinstance(self.error, OSError) and not self._state_lost()
            if sound:
                try:
                    self.save_checkpoint()
                except OSError as e:
                    self.fail(OSError(f"writing the final checkpoint {self.checkpoint_path} failed: {e}"))
            self._writer = None
        if self._trace is not None:
            try:
                self._trace.close()
            except OSError as e:  # the last flush of a full disk
                self.fail(OSError(f"writing {self._trace.path} failed: {e}"))

    def save_checkpoint(self) -> str:
        """Writes a consistent checkpoint now (atomically); returns its path."""
        if self.checkpoint_path is None:
            raise errors.ConfigError("this store has no checkpoint_dir: pass checkpoint_dir= to ParameterStore.")
        with self._lock:
            snapshot = self._checkpoint()
        checkpoint.save(self.checkpoint_path, *snapshot)
        return self.checkpoint_path

    def state(self) -> server.ServerState:
        """A consistent snapshot of the whole server state (a host copy: the store updates its own in place)."""
        with self._lock:
            return _host_copy(self._state)

    def final_weights(self) -> tuple[Any, Any]:
        """``(params, model_state)`` on the host at the end of a run: the server's, or, if a failing exchange consumed
        its donated state, the last weights it answered a push with."""
        with self._lock:
            if not self._state_lost():
                return _host_copy((self._state.params, self._state.model_state))
            return self.unpack(self._last_answer)

    def _state_lost(self) -> bool:
        return any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(self._state))

    def status(self) -> StoreStatus:
        """The counts and how the store stands."""
        with self._lock:
            return StoreStatus(
                applied=self.applied,
                rejected=self.rejected,
                late=self.late,
                received=self.received,
                closed=self.closed,
                error=None if self.error is None else str(self.error),
                resumed_from=self.resumed_from,
                positions=tuple(int(d) for d in self.positions),
                staleness_counts=dict(self.staleness_counts),
                ignored=self.ignored,
                times=self._times,
            )

    def take_snapshots(self) -> list[Snapshot]:
        """The snapshots of the weights taken since the last call (handed over)."""
        with self._lock:
            snapshots, self._snapshots = self._snapshots, []
        return snapshots

    @property
    def _zeros(self) -> tuple[tuple, tuple]:
        """A zero payload, packed (what compiles the exchange)."""
        zeros = lambda layout: tuple(np.zeros(n, d) for n, d in zip(layout.sizes, layout.dtypes, strict=True))
        return zeros(self.layout), zeros(self.model_state_layout) if self._stateful else ()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def wait_closed(self, timeout: float) -> bool:
        """Blocks until the store closes or ``timeout`` seconds pass; returns whether it is closed."""
        return self._closed.wait(timeout)

    # -- internals ----------------------------------------------------------------------------------------------------

    def _id(self, worker: int) -> jax.Array:
        return self._ids[worker]

    def _check_worker(self, worker: int) -> None:
        if not isinstance(worker, int | np.integer) or not 0 <= worker < self.num_workers:
            raise errors.ConfigError(f"worker={worker!r} is invalid: use an int in [0, {self.num_workers}).")

    def _misfit(self, payload: Any) -> str | None:
        if jax.tree.structure(payload) != self._structure:
            return f"tree structure {jax.tree.structure(payload)} differs from the model's {self._structure}"
        for i, (x, (shape, dtype)) in enumerate(zip(jax.tree.leaves(payload), self._leaves, strict=True)):
            x_dtype = x.dtype if hasattr(x, "dtype") else np.result_type(x)  # a jax.Array: its own dtype, no copy
            if np.shape(x) != shape or x_dtype != dtype:
                return f"leaf {i} is {x_dtype}{list(np.shape(x))}, the model's is {dtype}{list(shape)}"
        return None

    def _checkpoint(self) -> tuple:
        """What a checkpoint holds, as host copies: the state, each worker's data position, the header and counts."""
        counts = {"applied": self.applied, "rejected": self.rejected, "received": self.received, "late": self.late}
        counts["ignored"] = self.ignored
        staleness = {str(k): v for k, v in self.staleness_counts.items()}
        # The trace it belongs to: a resume keeps exactly these lines and refuses any other trace.
        pinned = {} if self._trace is None else {"trace_lines": self._trace.lines, "trace_sha256": self._trace.digest()}
        return (
            _host_copy(self._state),
            {"positions": self.positions.copy()},
            {**self.header, **counts, **pinned, "staleness_counts": staleness},
        )

    def fail(self, error: BaseException) -> None:
        """Stops the store with ``error`` (the first error wins): nothing more is applied, workers are told why.

        It never waits for the round's lock: the applier calls it while a worker holds that lock waiting for the very
        push being applied (an SSGD or round method's mean whose update diverged, a trace write on a full disk), and
        waiting there was a deadlock until the run's timeout. The rounds are called off at once; their waiters are
        woken by whoever holds the lock, or by a thread of their own."""
        log.error("the store stopped: %s", error)
        with self._error_lock:
            if self.error is None:
                self.error = error
        self._closed.set()
        self._notify_version()
        if self._round_abort is None:
            self._round_abort = f"the store stopped: {self.error}"  # read under the round's lock by its waiters
        if self._round_cv.acquire(blocking=False):
            try:
                self._round_cv.notify_all()
            finally:
                self._round_cv.release()
        else:
            threading.Thread(target=self.abort_rounds, args=(self._round_abort,), daemon=True).start()

    def _restore(self, path: str) -> None:
        state, arrays, header = checkpoint.load(path, self._state)
        _check_header(path, header, self.header)
        self._trace_pin = trace_pin(header)
        self._state = jax.device_put(state, self.device)
        self.applied, self.rejected, self.late = header["applied"], header["rejected"], header.get("late", 0)
        self.ignored = header.get("ignored", 0)
        # Pushes in flight at the checkpoint are lost and sent again.
        self.received = self.applied + self.rejected + self.ignored
        # Checkpoints written before 2026-12 call the positions "done"; they still load.
        self.positions = np.asarray(arrays["positions" if "positions" in arrays else "done"], np.int64).copy()
        self.staleness_counts.update({int(k): v for k, v in header["staleness_counts"].items()})
        self.resumed_from = self.applied
        log.info("resumed from %s at update %d", path, self.applied)

    def _closed_reason(self) -> str:
        if self.error is not None:
            return f"the store stopped: {self.error}"
        return f"the store is closed after {self.applied} updates"

    def _time(self, **seconds: float) -> None:
        """Adds to the store's times (:class:`StoreTimes`)."""
        with self._error_lock:
            t = self._times
            self._times = t._replace(**{k: getattr(t, k) + v for k, v in seconds.items()})

    def _apply_loop(self) -> None:
        item = None
        try:
            while True:
                t0 = time.perf_counter()
                if (item := self._queue.get()) is None:
                    break
                t1 = time.perf_counter()
                exchange_seconds = self._apply(*item)
                self._time(idle=t1 - t0, exchange=exchange_seconds, pushes=1)
                self._time(bookkeeping=time.perf_counter() - t1 - exchange_seconds)
        except BaseException as e:  # a dead applier stops the run at once, with its error
            self.fail(RuntimeError(f"the store's applier failed: {type(e).__name__}: {e}"))
            if item is not None and not item[-1].done():  # the push it died on is answered too
                with self._lock:
                    self.rejected += 1
                item[-1].set_exception(StoreClosed(self._closed_reason()))
        # Anything still queued after close is rejected, so pushes sent == applied + rejected.
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                with self._lock:
                    self.rejected += 1
                    self.late += 1
                item[-1].set_exception(StoreClosed(self._closed_reason()))

    def _apply(
        self,
        worker: int,
        payload: tuple,
        model_state: tuple,
        pulled_version: int,
        round_info: tuple | None,
        packed: bool,
        future: Future,
    ) -> float:
        """One push: rejected (late, non-finite) or applied with the server step, traced, and answered; the seconds
        its exchange program took (to its answer on the host). ``round_info``: a gathered round's mean (pushed as
        worker 0): its workers and their skips."""
        budget_reached = self.num_updates is not None and self.applied >= self.num_updates
        if self._closed.is_set() and (budget_reached or self.error is not None):
            with self._lock:
                self.rejected += 1
                self.late += 1
            future.set_exception(StoreClosed(self._closed_reason()))
            return 0.0
        if self.threshold is not None and self.applied - pulled_version >= self.threshold:
            future.set_result(self._ignore(worker, pulled_version, packed))
            return 0.0
        with self._lock:
            t0 = time.perf_counter()
            self._state, staleness, ok, sound, sent = self._exchange(
                self._state, self._id(worker), payload, model_state
            )
            ok, sound, staleness = (x.item() for x in jax.device_get((ok, sound, staleness)))
            answer = self._host(sent)
            seconds = time.perf_counter() - t0
            if ok:
                result = self._applied(worker, pulled_version, staleness, sound, answer, round_info, packed)
        if not ok:  # NaN/Inf: the exchange left the state as it was
            future.set_exception(self._reject_nonfinite(worker, pulled_version, round_info))
            return seconds
        self._notify_version()
        future.set_result(result)
        return seconds

    def _applied(
        self,
        worker: int,
        pulled_version: int,
        staleness: int,
        sound: bool,
        answer: tuple,
        round_info: tuple | None,
        packed: bool,
    ) -> tuple[Any, Any, int]:
        """Under the lock: the bookkeeping of an applied push (counts, trace, divergence, budget, checkpoint,
        snapshot); its reply."""
        self._nonfinite_streak = 0
        self.applied += 1
        self._use_minibatches(worker, round_info)
        self.staleness_counts[staleness] += 1
        self._write_trace(worker, pulled_version, staleness, round_info=round_info)  # what the server step saw
        self._last_answer = answer
        if not sound:
            self.diverged = True
            kept = (
                "the last checkpoint holds the last finite weights"
                if self.checkpoint_path is not None and os.path.exists(self.checkpoint_path)
                else "no checkpoint had been written yet"
            )
            self.fail(
                FloatingPointError(
                    f"the weights turned NaN or Inf at update {self.applied}: the run diverged (lower the learning "
                    f"rate); {kept}"
                )
            )
        elif self.num_updates is not None and self.applied >= self.num_updates:
            self._closed.set()
        due = self._writer is not None and self.checkpoint_every is not None and not self.diverged
        if due and self.applied % self.checkpoint_every == 0:
            self._writer.submit(*self._checkpoint())
        if self.snapshot_every and self.applied % self.snapshot_every == 0:
            # The server's weights (a pull-side rule sends a look-ahead instead: that is not what is evaluated).
            weights = self._host(self._weights(self._state)) if self._sends else answer
            self._snapshots.append(Snapshot(self.applied, *self.unpack(weights)))
        return (*self._reply(answer, packed), self.applied)

    def _ignore(self, worker: int, pulled_version: int, packed: bool) -> tuple[Any, Any, int]:
        """Ringmaster: a push ``threshold`` or more updates stale changes no weight; its worker pulls the current ones
        (its backup) and goes on with its next minibatches."""
        with self._lock:
            self.ignored += 1
            self.positions[worker] += 1
            self._write_trace(worker, pulled_version, self.applied - pulled_version, ignored=True)
        return self.pull(worker, packed=packed)

    def _use_minibatches(self, worker: int, round_info: tuple | None) -> None:
        """The data positions a push moves: its worker's, or every payload's of a gathered round (skips included)."""
        if round_info is None:
            self.positions[worker] += 1
            return
        for w, k in zip(*round_info, strict=True):
            self.positions[w] += 1 + k

    def _reject_nonfinite(self, worker: int, pulled_version: int, round_info: tuple | None = None) -> BadPush:
        """Counts a NaN/Inf push (its minibatches are used up, which the trace records so that a replay skips them
        too) and stops the store on policy or after a streak."""
        with self._lock:
            self.rejected += 1
            self._use_minibatches(worker, round_info)
            self._nonfinite_streak += 1
            streak = self._nonfinite_streak
            self._write_trace(
                worker, pulled_version, self.applied - pulled_version, rejected=True, round_info=round_info
            )
        message = f"push from worker {worker} (pulled at version {pulled_version}) holds NaN or Inf"
        if self.on_nonfinite == "stop":
            self.fail(BadPush(message + "; stopping (on_nonfinite='stop')"))
        elif streak >= self.max_nonfinite:
            self.fail(
                BadPush(
                    f"{streak} pushes in a row held NaN or Inf: the run diverged (lower the learning rate, check the "
                    f"data); stopped after max_nonfinite={self.max_nonfinite} (--max-nonfinite)"
                )
            )
        return BadPush(message)

    def _write_trace(
        self,
        worker: int,
        pulled_version: int,
        staleness: int,
        rejected: bool = False,
        ignored: bool = False,
        round_info: tuple | None = None,
    ) -> None:
        """Appends one record to the trace (under the lock, in the order pushes are handled)."""
        if self._trace is None:
            return
        record = trace.Record(
            worker=int(worker),
            workers=self.num_workers,
            pulled_version=int(pulled_version),
            applied_version=self.applied,
            staleness=int(staleness),
            time=time.perf_counter() - self._t0,
            rejected=rejected,
            ignored=ignored,
            round=None if round_info is None else tuple(int(w) for w in round_info[0]),
            round_skips=None if round_info is None else tuple(int(k) for k in round_info[1]),
        )
        try:
            self._trace.write(record)
        except OSError as e:
            self.fail(OSError(f"writing {self._trace.path} failed ({e}): free space and {self._way_on()}"))

    def _way_on(self) -> str:
        """How a stopped run goes on: from its checkpoint, or from the start when none was written yet."""
        if self.checkpoint_path is not None and os.path.exists(self.checkpoint_path):
            return "resume (--resume)"
        return "start again: no checkpoint had been written yet"


def trace_pin(header: dict[str, Any]) -> tuple[int, str | None]:
    """The trace lines a checkpoint belongs to and their SHA-256, from its header. Checkpoints written before the
    trace was pinned hold neither: their trace is cut at the applied count, unchecked."""
    return int(header.get("trace_lines", header.get("applied", 0))), header.get("trace_sha256")


def _check_header(path: str, saved: dict[str, Any], header: dict[str, Any]) -> None:
    mismatched = {k: (saved.get(k), v) for k, v in header.items() if saved.get(k) != v}
    if mismatched:
        details = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in mismatched.items())
        raise errors.ConfigError(
            f"Cannot resume from {path}: it was written by a different run ({details}). "
            "Use the same settings, or another output folder."
        )


def check_resume(out_dir: str | os.PathLike, header: dict[str, Any]) -> None:
    """What a store resuming in ``out_dir`` would refuse, checked where the run starts (before any store or worker is
    made, on any backend): a checkpoint of another run (its header differs from ``header``, which holds the worker
    count), or a trace that no longer reaches the checkpoint. Raises a ``ConfigError`` saying which."""
    path = os.path.join(os.fspath(out_dir), CHECKPOINT)
    saved = checkpoint.read_header(path)
    _check_header(path, saved, header)
    trace.whole_records(os.path.join(os.fspath(out_dir), trace.FILE), *trace_pin(saved))


def _host_copy(tree: Any) -> Any:
    """A NumPy copy that owns its memory (never a view of a buffer the store will donate)."""
    return jax.tree.map(lambda x: np.array(x, copy=True), tree)


def _finite_packed(buffers: tuple) -> jax.Array:
    """Whether every float of packed buffers is finite (inside a program: one read, fused with its neighbours)."""
    # x * 0 is 0 for a finite x and NaN for NaN or Inf: the sum is finite exactly when every x is. One reduction,
    # which XLA:CPU runs 2-4x faster than isfinite(x).all() (a materialised mask, then a chain of reductions).
    sums = [jnp.sum(b * 0) for b in buffers if jnp.issubdtype(b.dtype, jnp.inexact)]
    return jnp.isfinite(jnp.stack(sums).sum()) if sums else jnp.bool_(True)


def for_run(
    rule: optax.GradientTransformation,
    params: Any,
    config: Any,
    *,
    header: dict[str, Any],
    model_state: Any,
    evaluates: bool,
    resume: bool | None = None,
) -> ParameterStore:
    """The store of a trainer run, made from its :class:`asgd_jax.TrainConfig` (the one place a backend's store is
    built): its budget, output folder, checkpoints, snapshots for evaluation and non-finite policy. ``resume``
    defaults to the config's (the Ray store actor always resumes: Ray restarts it from its checkpoint)."""
    return ParameterStore(
        rule,
        params,
        config.plan.workers,
        model_state=model_state,
        num_updates=config.plan.num_updates,
        out_dir=config.out,
        on_nonfinite=config.on_nonfinite,
        checkpoint_dir=config.out,
        checkpoint_every=config.checkpoint_interval(),
        resume=config.resume if resume is None else resume,
        header=header,
        snapshot_every=config.eval_interval() if evaluates else None,
        max_nonfinite=config.max_nonfinite,
        threshold=config.plan.delays.threshold if isinstance(config.plan.delays, delays.Ringmaster) else None,
        gather=Gather.of(config.plan.delays),
    )


class Endpoint:
    """What workers talk to and what a driver polls: a :class:`ParameterStore`, in :mod:`asgd_jax.worker`'s terms.

    The one place where the store's exceptions become a worker's :class:`~asgd_jax.worker.Answer`: a bad or non-finite
    push is ``"rejected"``, a closed store ``"closed"``, an SSGD payload of a round already past ``"resync"``. In SSGD
    every round is pushed as worker 0, so every worker starts from worker 0's backup and data position.

    Args:
      store: the store.
      mode: the plan's mode (``"async"`` or ``"sync"``).
      timeout: the longest a push may wait for its answer (the run's timeout).
    """

    def __init__(self, store: ParameterStore, mode: str, timeout: float | None = None):
        self.store, self.mode, self.timeout = store, mode, timeout
        self._lock = threading.Lock()
        self._losses: list[float] = []

    def sync(self, worker: int) -> Sync:
        """``worker``'s backup (the weights it last pulled, packed host buffers) and its data position."""
        source = 0 if self.mode == "sync" else worker
        params, model_state, version = self.store.packed_backup(source)
        # A round method's workers read their own shards at their own pace; SSGD's all at the rounds'.
        position = self.store.positions[worker if self.store.gather is not None else source]
        return Sync(Weights(params, model_state, version), int(position))

    def pull(self, worker: int) -> Weights:
        """The current weights for ``worker`` (recorded as its backup): where a stopped computation restarts. In a
        round method every worker computes at the current weights, worker 0's backup (the rounds are its pushes)."""
        if self.mode == "sync":
            return Weights(*self.store.round_weights(packed=True))
        return Weights(*self.store.pull(worker, packed=True))

    def wait_version(self, version: int, timeout: float) -> int:
        """The store's applied updates once it reaches ``version`` or after ``timeout`` seconds; -1 once it closed."""
        applied = self.store.wait_version(version, timeout)
        return -1 if self.store.closed else applied

    def push(self, worker: int, payload: Any, version: int, model_state: Any, loss: float) -> Answer:
        """Applies a push of packed buffers (or, in SSGD, the round it completes) and answers it with packed
        weights."""
        store, timeout = self.store, self.timeout
        try:
            if store.gather is not None:
                weights = store.push_gathered(worker, payload, version, model_state, timeout, packed=True)
            elif self.mode == "sync":
                weights = store.push_round(worker, payload, version, model_state, timeout, packed=True)
            else:
                weights = store.push(worker, payload, version, model_state, packed=True).result(timeout=timeout)
        except StaleRound as e:
            if self.store.gather is not None:  # a computation its round's end stopped: again, on the same minibatches
                return Answer("restart", self.pull(worker), str(e))
            return Answer("resync", None, str(e))
        except StoreClosed as e:
            return Answer("closed", None, str(e))
        except BadPush as e:
            return Answer("rejected", None, str(e))
        with self._lock:
            self._losses.append(float(loss))
        if self.mode == "sync" and self.store.closed:  # that was the last round: nobody computes another one
            return Answer("closed", None, self.store.status().error or "the store reached its number of updates")
        return Answer("ok", Weights(*weights))

    def progress(self) -> Progress:
        """The store's status, the losses pushed since the last call and the snapshots taken since (handed over)."""
        with self._lock:
            losses, self._losses = self._losses, []
        return Progress(self.store.status(), losses, self.store.take_snapshots())

    def end(self, why: str) -> None:
        """Ends the run without an error (a worker the run cannot go on without died): rounds off, store closed."""
        self.store.abort_rounds(why)
        self.store.close()

    def fail(self, why: str) -> None:
        """Stops the run with an error (the driver could not write metrics.jsonl)."""
        self.store.fail(OSError(why))

    def close(self) -> tuple[Progress, Any, Any]:
        """Closes the store (final checkpoint); returns the last :meth:`progress` and the final weights."""
        self.store.close()
        return (self.progress(), *self.store.final_weights())
