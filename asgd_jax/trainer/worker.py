"""One worker's loop, written once: the same on a thread of this process and in a Ray actor.

A worker starts from what the store knows about it (:class:`Sync`: its backup, the version it pulled and its data
position), computes its exchange period on its device group and pushes the payload through a :class:`StoreLink` (as it
lies on the device to a store in this process, copied to the host for Ray or a round's mean), which answers with the
fresh weights (its next pull) or says why not (:class:`Answer`). Only the link differs between substrates: in process it
is the store's own :class:`asgd_jax.trainer.endpoint.Endpoint`; on Ray it is a client of the store actor that turns a
dead or restarting store into ``"resync"``.

Asynchronous and SSGD workers run the same loop: an SSGD worker's push is its share of a round, answered when the
round's mean has been applied.

Example:
  >>> from asgd_jax.trainer.worker import device_groups
  >>> import jax
  >>> len(device_groups(jax.devices("cpu")[:1], 1))
  1
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, SupportsFloat, SupportsInt, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from asgd_jax import cache, errors, exchange, packing
from asgd_jax import loss as loss_lib
from asgd_jax.exchange import Exchange
from asgd_jax.trainer.config import TrainConfig
from asgd_jax.trainer.loader import ShardLoader
from asgd_jax.trainer.messages import Answer, Checked, Computed, Sync, Weights, WorkerStats

__all__ = [
    "Computing",
    "DeviceGroup",
    "StoreLink",
    "WorkInputs",
    "Worker",
    "WorkerSetup",
    "device_groups",
    "stack_batches",
]

log = logging.getLogger("asgd_jax.trainer.worker")

STOP_POLL = 0.01
"""Seconds between a stoppable computation's checks of whether it is done (it wakes at once when the store moves)."""


class StoreLink(Protocol):
    """What a worker needs from a store, on any substrate."""

    def sync(self, worker: int) -> Sync:
        """The worker's backup and data position."""

    def push(
        self, worker: int, payload: Any, version: SupportsInt, model_state: Any, loss: SupportsFloat, inner: Any = None
    ) -> Answer:
        """A payload computed at ``version``; blocks until it is applied (or the SSGD round is). ``inner``: the
        worker's inner-optimizer state after it, which the store keeps for its checkpoints once it is applied."""

    def pull(self, worker: int) -> Weights:
        """The current weights, recorded as the worker's backup (a stopped computation restarts there)."""

    def wait_version(self, version: int, timeout: float) -> int:
        """The store's applied updates once they reach ``version``, or after ``timeout`` seconds; -1 once it closed."""


class Computing(StoreLink, Protocol):
    """A link to a pipelined store in this process, which computes the pushes of a worker on its device."""

    def push_computed(self, worker: int, push: Computed) -> Answer:
        """The worker's period and the exchange, one program of the store's; the answer carries the loss."""

    def warm_up_computed(self, worker: int, push: Computed) -> None:
        """Compiles that program before the run's clock starts."""


@dataclasses.dataclass(frozen=True)
class WorkerSetup:
    """Everything a worker is configured with, the same on every substrate.

    Attributes:
      worker: its id.
      num_workers: M (the workers' shards and SSGD's split of the model key).
      exchange: the run's exchange period (mode, n_sync, push, batch and shard sizes).
      local_lr: the local steps' learning rate (``None`` without local steps).
      seed: the run's seed (its key fixes the minibatch order and the model's randomness, the simulator's).
      stateful: the loss carries a model state, pushed with the payload.
      layouts: the packed forms of the weights and of the model state (:class:`asgd_jax.packing.Layout`): what
        crosses between the worker and the store.
      slowdown: a straggler computes this many times slower (1.0: not one).
      stop_stale: a computation that has become this many updates stale before it is done (its straggling included)
        is stopped and restarted at the current weights on the same minibatches: Ringmaster's R with stops, 1 for
        the round methods that stop at a round's end (the run's ``Discipline.stop_stale``); ``None``: never.
      direct: the payload and its loss go to the store as they lie on the worker's device (a store in this
        process: device to device, nothing waited for), not through the host.
      computed: the worker's device is a pipelined store's own (in this process): the store runs its period and the
        exchange as one program (:class:`~asgd_jax.trainer.messages.Computed`), where a period is one program (not
        a long period on XLA:CPU, a program per step: :func:`asgd_jax.exchange.period_loop`) and nothing waits on the
        period (no straggling, no stops).
      assignment: the run's fixed partition (:class:`asgd_jax.partition.Assignment`), None for IID shards.
      steps: DyLU (``Workers(dylu=True)``): the minibatches of the worker's periods that count, its share of
        ``n_sync`` by its speed (:meth:`asgd_jax.delays.Workers.local_steps`); ``None``: all of them.
    """

    worker: int
    num_workers: int
    exchange: exchange.Exchange
    local_lr: float | None
    seed: int
    stateful: bool
    layouts: tuple[packing.Layout, packing.Layout]
    slowdown: float = 1.0
    stop_stale: int | None = None
    direct: bool = False
    computed: bool = False
    assignment: Any = None
    steps: int | None = None

    @property
    def key(self) -> jax.Array:
        with jax.transfer_guard("allow"):
            return jax.random.key(self.seed)

    @property
    def period(self) -> int:
        """The minibatches an exchange period of this worker reads: ``n_sync``, or with DyLU its ``steps``."""
        return self.exchange.n_sync if self.steps is None else self.steps

    @classmethod
    def of_run(
        cls,
        config: TrainConfig,
        worker: int,
        ex: Exchange,
        stateful: bool,
        layouts,
        *,
        in_process: bool,
        assignment: Any = None,
    ) -> WorkerSetup:
        """Worker ``worker``'s setup in a run of ``config`` (its straggling, its discipline's stops; ``in_process``:
        the store is in this process, so a store on a device takes asynchronous payloads device to device)."""
        c = config
        dylu = getattr(c.plan.delays, "dylu", False)
        return cls(
            worker,
            c.plan.workers,
            ex,
            c.plan.local_lr,
            c.seed,
            stateful,
            layouts,
            c.slowdown.get(worker, 1.0),
            c.discipline.stop_stale,
            in_process and not c.discipline.rounds,  # (rounds average on the host)
            assignment=assignment,
            steps=int(c.plan.delays.local_steps(ex.n_sync)[worker]) if dylu else None,
        )


class WorkInputs(NamedTuple):
    """The arguments of :func:`asgd_jax.exchange.worker_function`'s function, in its order, placed on a group."""

    params: Any
    model_state: Any
    batches: Any
    model_key: jax.Array
    local_lr: jax.Array
    version: jax.Array
    worker: jax.Array


class DeviceGroup:
    """A worker's devices: the shardings of its mesh, and the run's model key and local learning rate placed on them
    once.

    A group of one device places everything on that device (a single-device sharding, the one a store on the same
    device answers with): weights that already lie there are not moved at all, and the minibatches cross to it in
    the program's own call (:meth:`feeding`: JAX's C++ path, ~40 us where a ``device_put`` of a batch costs ~240 us
    on a 2-core host). A larger group splits each minibatch over its devices with an explicit ``device_put``.
    """

    def __init__(self, devices: Sequence[jax.Device], model_key: jax.Array, local_lr: float | None = None):
        self.single = len(devices) == 1
        self.replicated: jax.sharding.Sharding
        self.batch_sharded: jax.sharding.Sharding
        if self.single:
            self.replicated = self.batch_sharded = jax.sharding.SingleDeviceSharding(devices[0])
        else:
            mesh = Mesh(np.array(devices), ("batch",))
            self.replicated, self.batch_sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P(None, "batch"))
        self.model_key = jax.device_put(model_key, self.replicated)
        self.local_lr = jax.device_put(np.float32(0.0 if local_lr is None else local_lr), self.replicated)
        self._ids: dict[int, jax.Array] = {}

    def place(self, worker: int, params, model_state, batches, version: SupportsInt) -> WorkInputs:
        """The inputs of :func:`asgd_jax.exchange.worker_function`'s function on this group, in one explicit
        transfer call: host arrays copied, arrays on another device moved, arrays already here (a pipelined store's
        answer on this device, its version still being computed) left as they are, never waited for."""
        if worker not in self._ids:
            self._ids[worker] = jax.device_put(np.int32(worker), self.replicated)
        v: Any = version if isinstance(version, jax.Array) else np.int32(version)
        moved = [x for x in jax.tree.leaves((params, model_state, v)) if not self._here(x)]
        if moved:  # (a pytree with the moved leaves only: one call)
            placed = iter(jax.device_put(moved, self.replicated))
            params, model_state, v = jax.tree.map(
                lambda x: x if self._here(x) else next(placed), (params, model_state, v)
            )
        batches = batches if self.single else jax.device_put(batches, self.batch_sharded)
        return WorkInputs(params, model_state, batches, self.model_key, self.local_lr, v, self._ids[worker])

    def feeding(self) -> contextlib.AbstractContextManager:
        """Where the program is called: a one-device group's host minibatches cross to its device in that call, the
        one host -> device transfer it makes, allowed there by name (its other inputs are already placed)."""
        return jax.transfer_guard_host_to_device("allow") if self.single else contextlib.nullcontext()

    def _here(self, x: Any) -> bool:
        return isinstance(x, jax.Array) and x.sharding == self.replicated


def device_groups(devices: Sequence[jax.Device], per_worker: int) -> list[list[jax.Device]]:
    """``devices`` cut into groups of ``per_worker`` (worker w owns group ``w mod len(groups)``)."""
    per_worker = errors.positive_int("devices_per_worker", per_worker)
    if per_worker > len(devices):
        raise errors.ConfigError(
            f"devices_per_worker={per_worker} but only {len(devices)} device(s) are available: use at most "
            f"{len(devices)} (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N gives N devices)."
        )
    return [list(devices[i * per_worker : (i + 1) * per_worker]) for i in range(len(devices) // per_worker)]


def stack_batches(batches: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """A worker's ``n_sync`` minibatches stacked on a leading axis (what the exchange period takes; one minibatch
    is a view of itself, not a copy)."""
    if len(batches) == 1:
        return {k: v[None] for k, v in batches[0].items()}
    return {k: np.stack([b[k] for b in batches]) for k in batches[0]}


class Worker:
    """One worker: its shard's minibatches, its exchange-period function jitted for its devices, and its loop.

    Args:
      setup: its configuration.
      link: its store (:class:`StoreLink`).
      loss: the run's :class:`asgd_jax.loss_lib.Loss`.
      data: the training data (host arrays); the worker reads its own shard.
      devices: its device group (its minibatch is split over them, the gradients averaged).
      shared: the exchange-period functions of the workers of this process, by how they loop (filled here): one
        jitted function for all of them, so workers on one device compile it once.
    """

    def __init__(
        self,
        setup: WorkerSetup,
        link: StoreLink,
        loss: loss_lib.Loss,
        data: Any,
        devices: list,
        shared: dict[str, Callable] | None = None,
    ):
        self.setup, self.link, self.data = setup, link, data
        ex = setup.exchange
        # How the local steps are compiled on these devices (XLA:CPU: unrolled, or a program per step when long).
        loop, unroll = exchange.period_loop(devices[0].platform, ex.n_sync)
        # One function for the workers of a process (``shared``: theirs, by way): the worker's id is an argument, so
        # workers that share a device share its compilation too (and the store's program of their computed pushes).
        shared = {} if shared is None else shared
        dylu = setup.steps is not None  # (one program taking the worker's steps: a scan, on any device)
        way = f"{loop} {unroll}"
        if way not in shared:
            shared[way] = exchange.worker_function(
                loss, ex, setup.num_workers, setup.layouts, loop=loop, dylu=dylu, unroll=unroll
            )
        self.work = shared[way]
        self.group = DeviceGroup(devices, exchange.split_key(setup.key)[2], setup.local_lr)
        one_program = loop == "scan" or ex.n_sync == 1
        self.computed = setup.computed and one_program and setup.slowdown <= 1.0 and setup.stop_stale is None
        self.computed = self.computed and not ex.keeps_inner_state and not dylu  # (a period of the worker's own)
        # The worker's state of its inner optimizer, on its devices, kept across its applied pushes (None: plain SGD,
        # or not made yet); ``_restored``: its leaves from the store's checkpoint, placed at the first computation.
        self.inner: Any = None
        self._restored: list | None = None
        self._inner_init = _INNER_INIT.get(
            (ex.inner, setup.layouts[0]), lambda: _make_inner_init(ex.inner, setup.layouts[0])
        )
        # DyLU: the worker's own steps, placed once on its devices (an argument: one program for every worker).
        self._steps = () if setup.steps is None else (jax.device_put(np.int32(setup.steps), self.group.replicated),)

    def _start(self) -> tuple[Weights, ShardLoader]:
        """The weights to compute at and a loader at the data position, from what the store knows."""
        s = self.setup
        weights, position, inner = self.link.sync(s.worker)
        if s.exchange.keeps_inner_state:  # where the store's books say its state is (a resume's, a re-sync's)
            self.inner, self._restored = None, inner
        loader = ShardLoader(
            self.data,
            worker=s.worker,
            num_workers=s.num_workers,
            batch_size=s.exchange.batch_size,
            key=s.key,
            start_batch=position * s.period,
            assignment=s.assignment,
        )
        return weights, loader

    def _compute(self, weights: Weights, batches: Any):
        """The exchange period at ``weights`` on ``batches``, dispatched (not waited for); with an inner optimizer its
        new state is the last output (kept by :meth:`run` once the push is applied)."""
        inputs = self.group.place(self.setup.worker, weights.params, weights.model_state, batches, weights.version)
        if not self.setup.exchange.keeps_inner_state:
            with self.group.feeding():
                return self.work(*inputs, *self._steps)
        if self.inner is None:  # the worker's first state, from the weights' shapes (or the store's, restored), placed
            # on its devices (a state that reads no input comes out of jit on the default device, whatever the input's)
            if self._restored is None:
                fresh = self._inner_init(inputs.params)
            else:  # (the state's structure only: nothing computed)
                structure = jax.tree.structure(jax.eval_shape(self._inner_init, inputs.params))
                fresh = jax.tree.unflatten(structure, self._restored)
            self.inner = jax.device_put(fresh, self.group.replicated)
        with self.group.feeding():
            return self.work(*inputs, self.inner, *self._steps)

    def warm_up(self) -> None:
        """Compiles the exchange-period function on one of this worker's minibatches (before a run's clock starts)."""
        weights, loader = self._start()
        try:
            batches = stack_batches([loader.batch(0)] * self.setup.exchange.n_sync)
            if self.computed:
                cast(Computing, self.link).warm_up_computed(self.setup.worker, self._computed(batches))
            else:
                jax.block_until_ready(self._compute(weights, batches))
        finally:
            loader.close()

    def _period(self, loader: ShardLoader) -> Any:
        """The next exchange period's minibatches, stacked: ``n_sync`` of them; with DyLU the worker's own ``steps``
        (what its shard moves by, as in the simulator), repeated up to ``n_sync`` (the rest count for nothing)."""
        taken = [next(loader) for _ in range(self.setup.period)]
        return stack_batches(taken + taken[-1:] * (self.setup.exchange.n_sync - len(taken)))

    def _computed(self, batches: Any) -> Computed:
        return Computed(self.work, batches, self.group.model_key, self.group.local_lr)

    def run(self, stop: threading.Event | None = None) -> WorkerStats:
        """Pushes until the store closes (or ``stop`` is set); returns where the worker's time went.

        The stats mean the same on every substrate: ``data`` is the wait for minibatches, ``compute`` the exchange
        period on the devices with its transfers (a straggler's extra time included), ``exchange`` the wait for the
        store's answer, ``total`` all of the loop.
        """
        stop = stop or threading.Event()
        if self.computed:
            return self._run_computed(stop)
        s, stats = self.setup, WorkerStats()
        weights, loader = self._start()
        batches = None  # kept while a computation on them is restarted
        try:
            while not stop.is_set():
                t0 = time.perf_counter()
                if batches is None:
                    batches = self._period(loader)
                t1 = time.perf_counter()
                out = self._compute(weights, batches)
                while not self._done(out, weights.version, t1, stop):  # stopped: again, at the current weights
                    stats.stop(time.perf_counter() - t1)
                    weights, t1 = self.link.pull(s.worker), time.perf_counter()
                    out = self._compute(weights, batches)
                payload, model_state, loss, finite = out[0], out[1], out[2], out[4]
                kept = out[5] if s.exchange.keeps_inner_state else None
                if not s.direct:  # (through the host: to a store elsewhere, a Ray actor; the inner state too)
                    payload, model_state, loss, finite, kept = jax.device_get(
                        (payload, model_state, loss, finite, kept)
                    )
                t2 = time.perf_counter()
                pushed = Checked(payload, finite)  # (its check made in the period's program: the store trusts it)
                answer = self.link.push(
                    s.worker, pushed, weights.version, model_state if s.stateful else None, loss, kept
                )
                t3 = time.perf_counter()
                if answer.status == "restart":  # its round ended first: the work is wasted, the minibatches kept
                    stats.stop(t3 - t1)
                    weights = answer.fresh()
                    continue
                batches = None
                stats.add(data=t1 - t0, compute=t2 - t1, exchange=t3 - t2, loss=loss)
                if answer.status == "ok":
                    weights = answer.fresh()
                    if s.exchange.keeps_inner_state and answer.applied:  # applied: the period's steps count (not
                        # an ignored or rejected one's: a pipelined store answers before it knows, and it rejects
                        # exactly the non-finite pushes)
                        if isinstance(finite, jax.Array):  # (on the devices: nothing waited for)
                            self.inner = _adopt(finite, out[5], self.inner)
                        elif finite:
                            self.inner = out[5]
                elif answer.status == "closed":
                    break
                else:  # "rejected" (NaN/Inf: its minibatches are used up) or "resync": start again from the store
                    if answer.status == "rejected":
                        log.warning("worker %d: %s", s.worker, answer.why)
                    loader.close()
                    weights, loader = self._start()
        finally:
            loader.close()
        return stats.settled()

    def _run_computed(self, stop: threading.Event) -> WorkerStats:
        """:meth:`run` for a worker whose pushes the store computes: its minibatches in, one program per update (its
        time is ``compute``: the period and the exchange are one program)."""
        s, stats, link = self.setup, WorkerStats(), cast(Computing, self.link)
        _, loader = self._start()  # (the store computes at the worker's backup: no weights to hold here)
        try:
            while not stop.is_set():
                t0 = time.perf_counter()
                batches = self._period(loader)
                t1 = time.perf_counter()
                answer = link.push_computed(s.worker, self._computed(batches))
                stats.add(data=t1 - t0, compute=time.perf_counter() - t1, exchange=0.0, loss=answer.loss)
                if answer.status != "ok":  # ("closed": a computed push is never rejected at once)
                    break
        finally:
            loader.close()
        return stats.settled()

    def _done(self, out: Any, version: SupportsInt, started: float, stop: threading.Event) -> bool:
        """Waits for a computation at ``version`` and, for a straggler, its extra time; False when it was stopped
        because the store moved ``stop_stale`` updates past ``version`` first (never without ``stop_stale``)."""
        s = self.setup
        limit = None if s.stop_stale is None else int(version) + s.stop_stale
        if limit is not None:
            leaves = jax.tree.leaves(out[:3])
            while not all(x.is_ready() for x in leaves):
                applied = self.link.wait_version(limit, STOP_POLL)
                if applied >= limit:
                    return False
                if applied < 0 or stop.is_set():  # the store closed: the push will be told
                    break
        if s.slowdown <= 1.0:
            return True
        jax.block_until_ready(out[:3])
        end = time.perf_counter() + (s.slowdown - 1.0) * (time.perf_counter() - started)
        while (left := end - time.perf_counter()) > 0 and not stop.is_set():  # ... but it says goodbye at once
            if limit is None:
                stop.wait(left)
                continue
            applied = self.link.wait_version(limit, min(left, STOP_POLL))
            if applied >= limit:
                return False
            if applied < 0:
                break
        return True


_INNER_INIT = cache.Kept(8)  # a worker's inner optimizer's init, per optimizer and layout: compiled once a process


def _make_inner_init(inner: str, layout: packing.Layout) -> Callable:
    return jax.jit(lambda packed: exchange.inner_optimizer(inner, 0.0).init(layout.unpack(packed)))


# The new inner state where the push was finite, else the old (on the worker's devices).
_adopt = jax.jit(lambda ok, new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old))
