"""The trainer on Ray: the parameter store as an actor, each worker an actor, exchanging through Ray's object store.

Same semantics as the threaded backend (:mod:`asgd_jax.threads`): the store actor wraps the very same
:class:`~asgd_jax.store.ParameterStore` (the simulator's server step, the trace, checkpoints), and a worker actor runs
the same jitted exchange-period function on the same minibatch order, so the recorded ``trace.jsonl`` replays in the
simulator. What Ray adds is processes and machines:

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
* The driver polls the store for its counts, the workers' losses and snapshots of the weights after every
  ``eval_every``-th update: it draws the progress bar, writes ``metrics.jsonl`` like the threaded trainer and evaluates
  the snapshots in a thread on ``eval_device`` (default: its CPU, so the workers keep the GPUs). Ctrl-C closes the
  store (final checkpoint) and raises ``KeyboardInterrupt``; ``resume=True`` continues.

Example (a local Ray instance; ``ray start --head`` and ``ray_address="auto"`` for a cluster)::

    config = asgd_jax.trainer.TrainConfig(workers=4, num_updates=1000, backend="ray")
    result = asgd_jax.trainer.train(loss, rule, params, data, config)
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import jax

from asgd_jax import errors, exchange, session
from asgd_jax.loader import ShardLoader
from asgd_jax.session import TrainConfig
from asgd_jax.store import BadPush, ParameterStore, StaleRound, StoreClosed

__all__ = ["StoreActor", "WorkerActor", "require_ray", "run"]

log = logging.getLogger("asgd_jax.ray")

INSTALL = "pip install 'asgd_jax[ray]'  (or: pip install ray)"
STARTUP_PATIENCE = 600.0  # seconds for the store and the workers to start and compile


def require_ray():
    """Imports Ray, or fails at once with the install command."""
    try:
        import ray
    except ImportError:
        raise errors.MissingDependency(
            f"backend='ray' (--backend ray) needs Ray, which is not installed: {INSTALL}"
        ) from None
    return ray


class StoreActor:
    """A :class:`ParameterStore` in an actor (threaded: pushes queue in the store while earlier ones are applied).

    It also keeps what the driver polls for its progress bar, ``metrics.jsonl`` and evaluations: the workers' losses
    since the last poll and host snapshots of the weights after every ``snapshot_every``-th update."""

    def __init__(self, rule, params, num_workers: int, kwargs: dict[str, Any], mode: str = "async"):
        self._snapshots: list[tuple] = []
        self._losses: list[float] = []
        self.store = ParameterStore(rule, params, num_workers, on_snapshot=self._snapshot, **kwargs)
        self.store.warm_up()
        self.mode, self.M = mode, num_workers

    def _snapshot(self, version: int, params, model_state) -> None:
        self._snapshots.append((version, params, model_state))  # host copies already (the applier hands them out)

    def sync(self, worker: int):
        """``worker``'s backup (weights it last pulled), model state, version and data position (in pushes). In SSGD
        every round is pushed as worker 0, so every worker starts from worker 0's backup and position."""
        source = 0 if self.mode == "sync" else worker
        params, model_state, version = self.store.backup(source)
        host = jax.device_get((params, model_state))
        return (*host, version, int(self.store.positions[source]))

    def push_sync(self, worker: int, payload, version: int, model_state, loss: float | None = None):
        """SSGD: :meth:`ParameterStore.push_round`, answered as ``("ok", weights)``, ``("resync", why)`` (computed on
        other weights than the store's, e.g. after a store restart) or ``("closed", why)``."""
        if loss is not None:
            self._losses.append(loss)
        try:
            answer = self.store.push_round(worker, payload, version, model_state)
        except StaleRound as e:
            return "resync", str(e)
        except StoreClosed as e:
            return "closed", str(e)
        if self.store.closed:  # that was the last round: nobody computes another one
            return "closed", "the store reached its number of updates"
        return "ok", answer

    def push(self, worker: int, payload, version: int, model_state, loss: float | None = None):
        """Applies a push; returns ``("ok", (params, model_state, version))``, ``("rejected", why)`` or
        ``("closed", why)``."""
        try:
            result = self.store.push(worker, payload, version, model_state).result()
        except StoreClosed as e:
            return "closed", str(e)
        except BadPush as e:
            return "rejected", str(e)
        if loss is not None:
            self._losses.append(loss)
        return "ok", result

    def status(self) -> dict[str, Any]:
        return self.store.status()

    def fail(self, message: str) -> None:
        """Stops the store with ``message`` (the driver's metrics file could not be written)."""
        self.store.fail(OSError(message))

    def progress(self) -> tuple[dict[str, Any], list[float], list[tuple]]:
        """The status, the losses pushed since the last call and the snapshots taken since then (both handed over)."""
        losses, self._losses = self._losses, []
        snapshots, self._snapshots = self._snapshots, []
        return self.status(), losses, snapshots

    def close(self):
        """Closes the store (final checkpoint); returns :meth:`progress` and the final weights."""
        self.store.close()
        return self.progress(), *self.store.final_weights()


class WorkerActor:
    """One asynchronous worker: its shard's minibatches, the jitted exchange-period function, a loop of pushes."""

    def __init__(self, worker, store, loss_fn, data, config: dict[str, Any]):
        self.w, self.store, self.data, self.c = worker, store, data, config
        self.stateful = config["stateful"]
        self.slowdown = config["slowdown"].get(worker, 1.0)
        self.mode = config["mode"]
        self.work = exchange.worker_function(loss_fn, config["ex"], config["num_workers"], config["local_lr"])
        devices = jax.devices()[: config["devices_per_worker"]]
        if len(devices) < config["devices_per_worker"]:
            raise errors.ConfigError(
                f"worker {worker} sees {len(jax.devices())} device(s), needs {config['devices_per_worker']}."
            )
        self.group = session.DeviceGroup(devices, exchange.split_key(config["key"])[2])

    def _sync(self, ray, patience: float = 120.0):
        """What the store knows about this worker, and a loader at its data position (waits out a store restart)."""
        deadline = time.perf_counter() + patience
        while True:
            try:
                params, model_state, version, position = ray.get(self.store.sync.remote(self.w))
                break
            except _actor_errors(ray):
                if time.perf_counter() > deadline:
                    raise
                time.sleep(0.5)
        c = self.c
        loader = ShardLoader(
            self.data,
            worker=self.w,
            num_workers=c["num_workers"],
            batch_size=c["batch_size"],
            key=c["key"],
            start_batch=position * c["n_sync"],
        )
        return params, model_state, version, loader

    def ping(self) -> int:
        return self.w

    def warm_up(self) -> None:
        """Compiles the exchange-period function on a minibatch of this worker's, before the driver starts the clock."""
        params, model_state, version, loader = self._sync(require_ray())
        try:
            batches = session.stack_batches([loader.batch(0)] * self.c["n_sync"])
            jax.block_until_ready(self.work(*self.group.place(self.w, params, model_state, batches, version)))
        finally:
            loader.close()

    def run(self) -> dict[str, Any]:
        """Pushes until the store closes; returns this worker's counts and timings."""
        ray = require_ray()
        c = self.c
        params, model_state, version, loader = self._sync(ray)
        stats = {"pushes": 0, "compute": 0.0, "exchange": 0.0, "losses": []}
        try:
            while True:
                batches = session.stack_batches([next(loader) for _ in range(c["n_sync"])])
                t0 = time.perf_counter()
                out = self.work(*self.group.place(self.w, params, model_state, batches, version))
                payload, new_ms, loss = jax.device_get(out[:3])
                t1 = time.perf_counter()
                if self.slowdown > 1:  # a straggler: this worker computes `slowdown` times slower
                    time.sleep((self.slowdown - 1.0) * (t1 - t0))
                    t1 = time.perf_counter()
                exchange = self.store.push_sync if self.mode == "sync" else self.store.push
                try:
                    status, result = ray.get(
                        exchange.remote(self.w, payload, version, new_ms if self.stateful else None, float(loss))
                    )
                except _actor_errors(ray):  # the store died: Ray restarts it from its last checkpoint; re-sync
                    log.warning("worker %d: the store restarted; re-syncing", self.w)
                    status, result = "resync", None
                if status == "resync":  # SSGD: this round was computed on other weights than the store's
                    loader.close()
                    params, model_state, version, loader = self._sync(ray)
                    continue
                stats["exchange"] += time.perf_counter() - t1
                stats["compute"] += t1 - t0
                stats["pushes"] += 1
                stats["losses"].append(float(loss))
                if status == "closed":
                    break
                if status == "rejected":  # non-finite: re-sync from the store and go on
                    log.warning("worker %d: %s", self.w, result)
                    loader.close()
                    params, model_state, version, loader = self._sync(ray)
                else:
                    params, model_state, version = result
        finally:
            loader.close()
        return stats


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
    loss: exchange.Loss,
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
) -> session.TrainResult:
    """One session of the Ray backend (the arguments are validated by :func:`asgd_jax.trainer.train`)."""
    ray = require_ray()
    if not ray.is_initialized():
        ray.init(address=config.ray_address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    out = None if config.out is None else os.path.abspath(config.out)
    if out is not None and os.path.exists(os.path.join(out, session.CHECKPOINT)) and not config.resume:
        raise errors.ConfigError(
            f"out={out!r} (--out) already holds a checkpoint: pass resume=True (--resume) to continue that run, or "
            "choose another output folder."
        )
    driver = _Driver(ray, config, out, eval_fn, eval_device, params, model_state)
    driver.start(loss, rule, params, data, ex, model_state, header)
    return driver.go()


class _Driver:
    """The driver's side of a Ray session: the actors, the progress bar, metrics.jsonl, the evaluator, failures."""

    def __init__(self, ray, config: TrainConfig, out, eval_fn, eval_device, params, model_state):
        self.ray, self.c, self.out, self.M = ray, config, out, config.plan.workers
        self.run_id = os.urandom(4).hex()
        self.metrics = session.MetricsLog(self.M)
        self.evaluator = None
        if eval_fn is not None:  # on the driver (its CPU by default), so that the workers keep the GPUs
            self.evaluator = session.Evaluator(eval_fn, eval_device or jax.devices("cpu")[0], self.metrics.write)
            self.evaluator.warm_up(jax.device_get(params), jax.device_get(model_state))
        self.failures: dict[int, str] = {}
        self.stats: dict[int, dict[str, Any]] = {}
        self.losses: list[float] = []
        self.status: dict[str, Any] = {}

    def start(self, loss, rule, params, data, ex, model_state, header) -> None:
        """The store actor (pinned to this node: the output folder is this machine's) and the worker actors, all
        compiled before the clock starts."""
        ray, c = self.ray, self.c
        gpus = ray.cluster_resources().get("GPU", 0) > 0
        resources = {"num_gpus": c.devices_per_worker} if gpus else {"num_cpus": 1}
        self._check_room(resources)
        here = ray.get_runtime_context().get_node_id()
        pin = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id=here, soft=False)
        store_kwargs = {
            "model_state": jax.device_get(model_state),
            "num_updates": c.plan.num_updates,
            "out_dir": self.out,
            "on_nonfinite": c.on_nonfinite,
            "checkpoint_dir": self.out,
            "checkpoint_every": c.checkpoint_interval(),
            "resume": self.out is not None,
            "header": header,
            "snapshot_every": c.eval_interval() if self.evaluator else None,
            "max_nonfinite": c.max_nonfinite,
        }
        self.store = (
            ray.remote(StoreActor)
            .options(
                name=f"asgd-jax/{self.run_id}/store",
                num_cpus=0,
                max_concurrency=self.M + 8,
                max_restarts=-1 if self.out else 0,
                max_task_retries=0,
                scheduling_strategy=pin,
            )
            .remote(rule, jax.device_get(params), self.M, store_kwargs, c.plan.mode)
        )
        worker_config = {
            "ex": ex,
            "num_workers": self.M,
            "local_lr": c.plan.local_lr,
            "key": c.key(),
            "devices_per_worker": c.devices_per_worker,
            "batch_size": c.plan.batch_size,
            "n_sync": ex.n_sync,
            "stateful": model_state is not None,
            "slowdown": c.slowdown,
            "mode": c.plan.mode,
        }
        data_ref = ray.put(data)
        actor = ray.remote(WorkerActor)
        self.workers = {
            w: actor.options(
                name=f"asgd-jax/{self.run_id}/worker-{w}", max_restarts=c.max_restarts, max_task_retries=0, **resources
            ).remote(w, self.store, loss, data_ref, worker_config)
            for w in range(self.M)
        }
        # The store up (and resumed) and every worker compiled before the clock starts, within a bound: an actor
        # the cluster has no room for would otherwise be waited for forever.
        self.patience = min(c.timeout, STARTUP_PATIENCE)
        deadline = time.perf_counter() + self.patience
        self.status = self._within(self.store.status.remote(), deadline, "the store actor")
        for w, ref in [(w, a.warm_up.remote()) for w, a in self.workers.items()]:
            try:
                self._within(ref, deadline, f"worker actor {w}")
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:  # its run() fails the same way
                log.warning("a worker's warm-up failed: %s", e)
        if self.out is not None:
            os.makedirs(self.out, exist_ok=True)
        self.metrics.open(
            self.out,
            append=bool(self.status["resumed_from"]),
            applied=self.status["applied"],
            pushes=self.status["positions"],
            staleness_counts=self.status["staleness_counts"],
        )

    def _check_room(self, resources: dict[str, float]) -> None:
        """Fails at once when the cluster, even idle, cannot hold every worker actor (they would wait forever)."""
        ((name, each),) = resources.items()
        kind = "GPU" if name == "num_gpus" else "CPU"
        have = self.ray.cluster_resources().get(kind, 0)
        if have < self.M * each:
            raise errors.ConfigError(
                f"--workers {self.M} needs {self.M * each:g} {kind}s on the Ray cluster ({each:g} per worker actor), "
                f"which has {have:g}: use --workers {int(have // each)} or fewer, or add nodes (an autoscaling "
                "cluster: start them first)."
            )

    def _within(self, ref, deadline: float, what: str):
        """``ray.get(ref)`` by ``deadline``, or the run stops (its actors killed) saying what did not start."""
        ray = self.ray
        try:
            return ray.get(ref, timeout=max(1.0, deadline - time.perf_counter()))
        except ray.exceptions.GetTimeoutError:
            for actor in [*self.workers.values(), self.store]:
                ray.kill(actor)
            free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
            raise errors.RunStopped(
                f"{what} did not start within {self.patience:g} s (free on the cluster: {free}): the cluster may "
                f"lack room for {self.M} worker actors; free resources or use fewer --workers"
            ) from None

    def _take(self, polled) -> None:
        """A poll of the store: its status, the losses since the last poll, snapshots for the evaluator."""
        self.status, new_losses, snapshots = polled
        self.losses.extend(new_losses)
        for snapshot in snapshots if self.evaluator is not None else ():
            self.evaluator.submit(*snapshot)

    def _record(self, final: bool = False) -> dict[str, Any]:
        s = self.status
        record = self.metrics.record(
            applied=s["applied"],
            rejected=s["rejected"],
            elapsed=time.perf_counter() - self.start_time,
            pushes=s["positions"],
            new_losses=self.losses,
            staleness_counts=s["staleness_counts"],
            final=final,
        )
        self.losses = []
        return record

    def _failed(self, w: int, error: BaseException, running: dict) -> None:
        """A worker actor died: restart it (it re-syncs from the store), drop it, or stop the run."""
        ray, c = self.ray, self.c
        self.failures[w] = f"{type(error).__name__}: {error}"[:500]
        log.error("worker %d failed: %s", w, self.failures[w])
        if c.on_worker_failure != "stop" and self.restarts[w] < c.max_restarts and _alive(ray, self.workers[w]):
            self.restarts[w] += 1  # Ray restarted the actor; in SSGD it rejoins its round
            log.warning("worker %d restarted (%d of %d)", w, self.restarts[w], c.max_restarts)
            running[self.workers[w].run.remote()] = w
        elif c.on_worker_failure == "stop" or c.plan.mode == "sync":  # SSGD cannot go on without a worker
            ray.get(self.store.close.remote())

    def _loop(self, bar) -> bool:
        """Watches the workers and polls the store until the workers are done; True at the deadline."""
        ray = self.ray
        running = {self.workers[w].run.remote(): w for w in self.workers}
        self.restarts = dict.fromkeys(self.workers, 0)
        deadline, next_log = self.start_time + self.c.timeout, self.start_time + self.c.log_every
        while running:
            if time.perf_counter() >= deadline:
                return True
            ready, _ = ray.wait(list(running), num_returns=1, timeout=min(0.25, self.c.log_every))
            for ref in ready:
                w = running.pop(ref)
                try:
                    self.stats[w] = _merge(self.stats.get(w), ray.get(ref))
                except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                    self._failed(w, e, running)
            try:
                self._take(ray.get(self.store.progress.remote()))
            except _actor_errors(ray):  # the store is restarting from its checkpoint: poll again later
                continue
            if time.perf_counter() >= next_log:
                next_log += self.c.log_every
                record = self._record()
                self.metrics.write(record)
                if self.metrics.error is not None:  # a full disk: stop now, the checkpoint is still good
                    ray.get(self.store.fail.remote(f"writing metrics.jsonl failed: {self.metrics.error}"))
                bar.update(self.status["applied"] - bar.n)
                if record["loss"] is not None:
                    bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
        return False

    def go(self) -> session.TrainResult:
        from tqdm.auto import tqdm

        ray, interrupted, timed_out = self.ray, False, False
        self.start_time = time.perf_counter()
        self.metrics.restart_clock(self.start_time)
        bar = tqdm(
            total=self.c.plan.num_updates,
            initial=self.status["applied"],
            disable=not self.c.progress,
            unit="update",
            desc=f"{self.c.plan.mode} x{self.M} (ray)",
            dynamic_ncols=True,
        )
        try:
            timed_out = self._loop(bar)
        except KeyboardInterrupt:
            interrupted = True
            log.warning("interrupted: stopping the workers and writing a final checkpoint")
        finally:
            try:
                polled, final_params, final_ms = ray.get(self.store.close.remote())
            finally:
                for actor in self.workers.values():
                    ray.kill(actor)
                ray.kill(self.store)
                bar.close()
        seconds = time.perf_counter() - self.start_time
        self._take(polled)
        stats = [self.stats.get(w, {"pushes": 0, "compute": 0.0, "exchange": 0.0, "losses": []}) for w in range(self.M)]
        outcome = session.Outcome(
            params=final_params,
            model_state=final_ms,
            status=self.status,
            failures=self.failures,
            seconds=seconds,
            losses={w: s["losses"] for w, s in self.stats.items()},
            workers=[
                session.WorkerStats(
                    pushes=s["pushes"], compute=s["compute"], exchange=s["exchange"], total=s["compute"] + s["exchange"]
                )
                for s in stats
            ],
            interrupted=interrupted,
            timed_out=timed_out,
        )
        return session.finish(
            outcome,
            out_dir=self.out,
            metrics=self.metrics,
            evaluator=self.evaluator,
            final_record=lambda: self._record(final=True),
            summary={},
        )


def _merge(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    if old is None:
        return new
    return {k: old[k] + new[k] for k in new}
