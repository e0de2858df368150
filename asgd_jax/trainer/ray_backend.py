"""The trainer on Ray: the parameter store as an actor, each worker an actor, exchanging through Ray's object store.

Same semantics as the threaded backend (:mod:`asgd_jax.trainer.threads`), and the same code: the store actor holds the
store's :class:`~asgd_jax.trainer.endpoint.Endpoint` (the simulator's server step, the trace, checkpoints), a worker
actor runs the one :class:`asgd_jax.trainer.worker.Worker` loop through a link to it, and
:func:`asgd_jax.trainer.driver.drive` runs the session, so the recorded ``trace.jsonl`` replays in the simulator. What
Ray adds is processes and machines:

* Worker actors ask for ``num_gpus=devices_per_worker`` when the cluster has GPUs (Ray sets
  ``CUDA_VISIBLE_DEVICES``), one CPU otherwise. The store actor is pinned to the driver's node, so ``out_dir`` (trace,
  checkpoints) is on the driver's file system.
* A worker (re)starts from what the store knows about it: its backup (the weights it last pulled) and its data
  position (pushes the store applied or rejected for it). So a worker actor that dies, whether killed or crashed, is
  reported and, with ``max_restarts``, restarted by Ray and picks up exactly there; otherwise it is dropped and the
  run goes on (``on_worker_failure="continue"``) or stops (``"stop"``).
* With ``out_dir`` the store actor checkpoints every ``checkpoint_every`` updates and Ray restarts it if it dies: it
  resumes from its last checkpoint (the trace is cut back to it) and the workers re-sync from it.
* ``mode="sync"`` (SSGD): the store actor collects each round's payloads from all workers and applies their mean once,
  as the threaded trainer does; a restarted worker re-syncs to the store's version and rejoins the round it left (it
  recomputes the same minibatches), a worker lost for good stops the run.
* The driver (the same as the threaded backend's) polls the store actor; evaluations run in a thread on
  ``eval_device`` (default: the driver's CPU, so the workers keep the GPUs). Ctrl-C closes the store (final
  checkpoint) and raises ``KeyboardInterrupt``; ``resume=True`` continues.

Example (a local Ray instance; ``ray start --head`` and ``ray_address="auto"`` for a cluster)::

    config = asgd_jax.TrainConfig(asgd_jax.Plan(4, num_updates=1000), backend="ray")
    result = asgd_jax.trainer.train(loss, rule, params, data, config)
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, SupportsFloat, SupportsInt

import jax

from asgd_jax import errors, exchange, packing
from asgd_jax import loss as loss_lib
from asgd_jax.ray_cluster import join, require_ray
from asgd_jax.trainer import driver, session
from asgd_jax.trainer.config import TrainConfig
from asgd_jax.trainer.endpoint import Endpoint, for_run
from asgd_jax.trainer.messages import Answer, Finished, Progress, StoreStatus, Sync, Weights, WorkerStats
from asgd_jax.trainer.worker import Worker, WorkerSetup

__all__ = ["StoreActor", "WorkerActor", "run"]

log = logging.getLogger("asgd_jax.ray")

STARTUP_PATIENCE = 600.0  # seconds for the store and the workers to start and compile
STORE_PATIENCE = 120.0  # seconds a worker waits for a restarting store


class StoreActor:
    """The run's store in an actor (threaded: a push moves its payload to the store's device while earlier ones are
    applied), serving its :class:`~asgd_jax.trainer.endpoint.Endpoint` to the workers and the driver. It always
    resumes from its checkpoint when there is one: Ray restarts it there (the driver refused a stale one before
    starting it)."""

    def __init__(self, rule, params, config: TrainConfig, header: dict[str, Any], model_state, evaluates: bool):
        config = config.replace(store_device=config.store_device.partition(":")[0])  # the one device Ray gave it
        the_store = for_run(
            rule, params, config, header=header, model_state=model_state, evaluates=evaluates, resume=True
        )
        the_store.warm_up(checked=not config.discipline.rounds)
        self.endpoint = Endpoint(the_store, config.discipline, timeout=config.timeout)

    def sync(self, worker: int) -> Sync:
        return self.endpoint.sync(worker)

    def push(self, worker: int, payload, version: SupportsInt, model_state, loss: SupportsFloat, inner=None) -> Answer:
        return self.endpoint.push(worker, payload, version, model_state, loss, inner)

    def pull(self, worker: int) -> Weights:
        return self.endpoint.pull(worker)

    def wait_version(self, version: int, timeout: float) -> int:
        return self.endpoint.wait_version(version, timeout)

    def progress(self) -> Progress:
        return self.endpoint.progress()

    def end(self, why: str) -> None:
        self.endpoint.end(why)

    def fail(self, why: str) -> None:
        self.endpoint.fail(why)

    def close(self) -> tuple[Progress, Any, Any]:
        return self.endpoint.close()


class _StoreLink:
    """A worker's link to the store actor: a dead or restarting store (Ray brings it back from its checkpoint) is
    waited out on a sync and answered ``"resync"`` on a push."""

    def __init__(self, actor):
        self.actor, self.ray = actor, require_ray()

    def sync(self, worker: int) -> Sync:
        deadline = time.perf_counter() + STORE_PATIENCE
        while True:
            try:
                return self.ray.get(self.actor.sync.remote(worker))
            except _actor_errors(self.ray):
                if time.perf_counter() > deadline:
                    raise
                time.sleep(0.5)

    def push(self, worker: int, payload, version: SupportsInt, model_state, loss: SupportsFloat, inner=None) -> Answer:
        try:
            return self.ray.get(self.actor.push.remote(worker, payload, version, model_state, loss, inner))
        except _actor_errors(self.ray):
            log.warning("worker %d: the store restarted; re-syncing", worker)
            return Answer("resync", None, "the store restarted")

    def pull(self, worker: int) -> Weights:
        try:
            return self.ray.get(self.actor.pull.remote(worker))
        except _actor_errors(self.ray):  # a restarting store: start again from the backup it comes back with
            return self.sync(worker).weights

    def wait_version(self, version: int, timeout: float) -> int:
        try:
            return self.ray.get(self.actor.wait_version.remote(version, timeout))
        except _actor_errors(self.ray):
            return -1  # nothing to wait on: the computation finishes and its push meets the restarted store


class WorkerActor:
    """One worker in an actor: the one :class:`asgd_jax.trainer.worker.Worker` loop on the devices Ray gave it."""

    def __init__(self, setup: WorkerSetup, store_actor, loss, data, devices_per_worker: int):
        devices = jax.devices()[:devices_per_worker]
        if len(devices) < devices_per_worker:
            raise errors.ConfigError(
                f"worker {setup.worker} sees {len(jax.devices())} device(s), needs {devices_per_worker}."
            )
        self.worker = Worker(setup, _StoreLink(store_actor), loss, data, devices)

    def ping(self) -> bool:
        return True

    def warm_up(self) -> None:
        """Compiles the exchange-period function, before the driver starts the clock."""
        self.worker.warm_up()

    def run(self) -> WorkerStats:
        """Pushes until the store closes; returns where this worker's time went."""
        return self.worker.run()


def _alive(ray, actor, patience: float = 120.0) -> bool:
    """Waits until Ray has restarted ``actor`` (a call to a restarting actor fails rather than waits); False if it is
    gone for good or not back within ``patience`` seconds."""
    deadline = time.perf_counter() + patience
    while time.perf_counter() < deadline:
        try:
            ray.get(actor.ping.remote())
            return True
        except getattr(ray.exceptions, "ActorUnavailableError", ()):  # still restarting
            time.sleep(0.2)
        except ray.exceptions.RayActorError:  # dead (no restarts left)
            return False
    return False


def _actor_errors(ray) -> tuple[type[BaseException], ...]:
    errors = [ray.exceptions.RayActorError]
    if hasattr(ray.exceptions, "ActorUnavailableError"):
        errors.append(ray.exceptions.ActorUnavailableError)
    return tuple(errors)


def run(
    loss: loss_lib.Loss,
    rule,
    params,
    data,
    config: TrainConfig,
    *,
    ex: exchange.Exchange,
    model_state,
    eval_fn,
    eval_device,
    header: dict[str, Any],
    on_metrics: Callable[[dict], Any] | None = None,
    assignment: Any = None,
) -> session.TrainResult:
    """One session of the Ray backend (the arguments are validated by :func:`asgd_jax.trainer.train`)."""
    ray = require_ray()
    join(config.ray_address)
    if config.out is not None:  # the store actor writes there: an absolute path on the driver's node
        config = config.replace(out=os.path.abspath(config.out))
    # Evaluations on the driver (its CPU by default), so that the workers keep the GPUs.
    metrics, evaluator = driver.logs(config, eval_fn, eval_device or jax.devices("cpu")[0], on_metrics)
    if evaluator is not None:
        evaluator.warm_up(jax.device_get(params), jax.device_get(model_state))
    backend = _Ray(ray, config, assignment)
    status = backend.start(loss, rule, params, data, ex, model_state, header, evaluator is not None)
    try:
        if config.out is not None:
            os.makedirs(config.out, exist_ok=True)
        metrics.open(config.out, status)
    except BaseException:  # (a full disk: the actors, started already, go; the checkpoint stays as it was)
        backend.kill()
        raise
    return driver.drive(backend, config, metrics, evaluator, status)


class _Ray:
    """The driver's :class:`asgd_jax.trainer.driver.Backend` over a store actor and M worker actors."""

    def __init__(self, ray, config: TrainConfig, assignment: Any = None):
        self.ray, self.c, self.m = ray, config, config.plan.workers
        self.assignment = assignment  # the run's fixed partition (None: IID shards)
        self.run_id = os.urandom(4).hex()
        self.workers: dict[int, Any] = {}
        self.running: dict[Any, int] = {}
        self.said_goodbye: list[Finished] = []  # the workers that ended as the store closed
        self.kept: list[Any] = []  # the actors' constructor arguments, alive for their restarts

    def start(self, loss, rule, params, data, ex, model_state, header, evaluates: bool) -> StoreStatus:
        """The store actor (pinned to this node: the output folder is this machine's) and the worker actors, all
        compiled before the clock starts and within a bound; returns the store's status."""
        ray, c = self.ray, self.c
        gpus = ray.cluster_resources().get("GPU", 0) > 0
        resources = {"num_gpus": c.devices_per_worker} if gpus else {"num_cpus": 1}
        self._check_room(resources)
        here = ray.get_runtime_context().get_node_id()
        pin = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id=here, soft=False)
        self.store = (
            ray.remote(StoreActor)
            .options(
                name=f"asgd-jax/{self.run_id}/store",
                num_cpus=0,
                num_gpus=0 if c.store_device == "cpu" else 1,
                max_concurrency=self.m + 8,
                max_restarts=-1 if c.out else 0,
                max_task_retries=0,
                scheduling_strategy=pin,
            )
            .remote(*self.keep(rule, jax.device_get(params), c, header, jax.device_get(model_state), evaluates))
        )
        (data_ref,) = self.keep(data)
        actor = ray.remote(WorkerActor)
        stateful = model_state is not None
        layouts = packing.layouts(params, model_state)
        for w in range(self.m):
            setup = WorkerSetup.of_run(c, w, ex, stateful, layouts, in_process=False, assignment=self.assignment)
            self.workers[w] = actor.options(
                name=f"asgd-jax/{self.run_id}/worker-{w}", max_restarts=c.max_restarts, max_task_retries=0, **resources
            ).remote(*self.keep(setup, self.store, loss), data_ref, c.devices_per_worker)
        # The store up (and resumed) and every worker compiled before the clock starts, within a bound: an actor
        # the cluster has no room for would otherwise be waited for forever.
        self.patience = min(c.timeout, STARTUP_PATIENCE)
        deadline = time.perf_counter() + self.patience
        status = self._within(self.store.progress.remote(), deadline, "the store actor").status
        for w, ref in [(w, a.warm_up.remote()) for w, a in self.workers.items()]:
            try:
                self._within(ref, deadline, f"worker actor {w}")
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:  # its run() fails the same way
                log.warning("a worker's warm-up failed: %s", e)
        self.running = {a.run.remote(): w for w, a in self.workers.items()}
        return status

    def keep(self, *args: Any) -> list[Any]:
        """``args`` put in Ray's object store, their references held by this driver for the whole run: Ray restarts a
        dead actor by calling its constructor again with the same arguments, which must still exist then (an argument
        of any size: weights of a million parameters are not inlined into the call, and were freed once the first
        constructor had run)."""
        refs = [self.ray.put(a) for a in args]
        self.kept.extend(refs)
        return refs

    def _check_room(self, resources: Mapping[str, float]) -> None:
        """Fails at once when the cluster, even idle, cannot hold every worker actor (they would wait forever)."""
        ((name, each),) = resources.items()
        kind = "GPU" if name == "num_gpus" else "CPU"
        have = self.ray.cluster_resources().get(kind, 0)
        if have < self.m * each:
            raise errors.ConfigError(
                f"--workers {self.m} needs {self.m * each:g} {kind}s on the Ray cluster ({each:g} per worker actor), "
                f"which has {have:g}: use --workers {int(have // each)} or fewer, or add nodes (an autoscaling "
                "cluster: start them first)."
            )

    def _within(self, ref, deadline: float, what: str):
        """``ray.get(ref)`` by ``deadline``, or the run stops (its actors killed) saying what did not start."""
        ray = self.ray
        try:
            return ray.get(ref, timeout=max(1.0, deadline - time.perf_counter()))
        except ray.exceptions.GetTimeoutError:
            self.kill()
            free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
            raise errors.RunStopped(
                f"{what} did not start within {self.patience:g} s (free on the cluster: {free}): the cluster may "
                f"lack room for {self.m} worker actors; free resources or use fewer --workers"
            ) from None

    def kill(self) -> None:
        """Ends every actor at once (a session that cannot go on)."""
        for actor in [*self.workers.values(), self.store]:
            self.ray.kill(actor)

    def poll(self) -> Progress | None:
        try:
            return self.ray.get(self.store.progress.remote())
        except _actor_errors(self.ray):  # the store is restarting from its checkpoint: poll again later
            return None

    def wait(self, timeout: float) -> list[Finished]:
        ray, out = self.ray, self.said_goodbye
        self.said_goodbye = []
        if not self.running:
            return out
        ready, _ = ray.wait(list(self.running), num_returns=len(self.running), timeout=timeout)
        for ref in ready:
            w = self.running.pop(ref)
            try:
                out.append(Finished(w, ray.get(ref)))
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                out.append(Finished(w, None, f"{type(e).__name__}: {e}"[:500]))
        return out

    def restart(self, worker: int) -> bool:
        if not _alive(self.ray, self.workers[worker]):  # Ray restarts a dead actor while it has restarts left
            return False
        self.running[self.workers[worker].run.remote()] = worker
        return True

    def end(self, why: str) -> None:
        self.ray.get(self.store.end.remote(why))

    def fail(self, why: str) -> None:
        self.ray.get(self.store.fail.remote(why))

    def close(self) -> tuple[Progress, Any, Any]:
        try:
            final = self.ray.get(self.store.close.remote())
            # The workers' next push is answered "closed": a moment for them to end and report (a straggler asleep
            # in its actor is not waited for, nor is anyone after a second Ctrl-C: the final checkpoint is written).
            with contextlib.suppress(KeyboardInterrupt):
                self.said_goodbye = self.wait(driver.GOODBYE)
                with contextlib.suppress(*_actor_errors(self.ray)):  # the counts as the workers left them
                    final = (final[0].followed_by(self.ray.get(self.store.progress.remote())), *final[1:])
            return final
        finally:
            self.kill()
            self.running = {}
