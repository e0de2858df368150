"""The trainer on Ray: the parameter store as an actor, each worker an actor, exchanging through Ray's object store.

Same semantics as the threaded trainer (:mod:`asgd_jax.trainer`): the store actor wraps the very same
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

    result = asgd_jax.trainer.train(loss, rule, params, data, num_workers=4, steps=1000, backend="ray")
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import jax

from asgd_jax import simulator, trainer
from asgd_jax.loader import ShardLoader
from asgd_jax.store import BadPush, ParameterStore, StoreClosed

__all__ = ["require_ray", "train_ray"]

log = logging.getLogger("asgd_jax.ray")

INSTALL = "pip install 'asgd_jax[ray]'  (or: pip install ray)"


def require_ray():
    """Imports Ray, or fails at once with the install command."""
    try:
        import ray
    except ImportError:
        raise ImportError(f"backend='ray' needs Ray, which is not installed: {INSTALL}") from None
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
        # SSGD rounds: this round's payloads by worker, the round's number and answer, and why rounds were called off.
        self._round: dict[int, tuple] = {}
        self._round_no, self._answer, self._aborted = 0, None, None
        self._cv = threading.Condition()

    def _snapshot(self, version: int, params, model_state) -> None:
        self._snapshots.append((version, params, model_state))  # host copies already (the applier hands them out)

    def sync(self, worker: int):
        """``worker``'s backup (weights it last pulled), model state, version and data position (in pushes). In SSGD
        every round is pushed as worker 0, so every worker starts from worker 0's backup and position."""
        source = 0 if self.mode == "sync" else worker
        params, model_state, version = self.store.backup(source)
        host = jax.device_get((params, model_state))
        return (*host, version, int(self.store.done[source]))

    def push_sync(self, worker: int, payload, version: int, model_state, loss: float | None = None):
        """SSGD: waits for every worker's payload of this round, applies their mean once (as worker 0) and gives all of
        them the same answer: ``("ok", weights)``, ``("resync", why)`` (computed on other weights than the store's,
        e.g. after a store restart) or ``("closed", why)``."""
        with self._cv:
            if self._aborted is not None:
                return "closed", self._aborted
            if version != self.store.version:
                return "resync", f"computed at version {version}, the store is at {self.store.version}"
            if loss is not None:
                self._losses.append(loss)
            self._round[worker] = (payload, model_state)
            number = self._round_no
            if len(self._round) == self.M:  # the last one in applies the round
                payloads = [self._round[w] for w in range(self.M)]  # worker order: the threaded trainer's sum
                mean = trainer._mean_tree([p for p, _ in payloads])
                ms = trainer._mean_tree([m for _, m in payloads]) if payloads[0][1] is not None else None
                try:
                    self._answer = "ok", self.store.push(0, mean, version, ms).result()
                    if self.store.closed:  # that was the last round: nobody computes another one
                        self._answer = "closed", "the store reached its number of updates"
                except StoreClosed as e:
                    self._answer = "closed", str(e)
                except BadPush as e:  # a non-finite mean: skipped; the next round starts from the same weights
                    log.warning("sync step: %s", e)
                    params, model_state, at = self.store.backup(0)
                    self._answer = "ok", (*jax.device_get((params, model_state)), at)
                self._round, self._round_no = {}, number + 1
                self._cv.notify_all()
            else:
                self._cv.wait_for(lambda: self._round_no != number or self._aborted is not None)
                if self._round_no == number:
                    return "closed", self._aborted
            return self._answer

    def _abort_rounds(self, why: str) -> None:
        with self._cv:
            self._aborted = why
            self._cv.notify_all()

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
        s = self.store
        return {"applied": s.applied, "rejected": s.rejected, "late": s.late, "received": s.received,
                "closed": s.closed, "error": None if s.error is None else str(s.error),
                "resumed_from": s.resumed_from, "done": [int(d) for d in s.done],
                "staleness_counts": dict(s.staleness_counts)}  # fmt: skip

    def progress(self) -> tuple[dict[str, Any], list[float], list[tuple]]:
        """The status, the losses pushed since the last call and the snapshots taken since then (both handed over)."""
        losses, self._losses = self._losses, []
        snapshots, self._snapshots = self._snapshots, []
        return self.status(), losses, snapshots

    def close(self):
        """Closes the store (final checkpoint); returns :meth:`progress` and the final weights."""
        self._abort_rounds("the store was closed")
        self.store.close()
        final = self.store.state()
        return self.progress(), final.params, final.model_state


class WorkerActor:
    """One asynchronous worker: its shard's minibatches, the jitted exchange-period function, a loop of pushes."""

    def __init__(self, worker, store, loss_fn, data, config: dict[str, Any]):
        self.w, self.store, self.data, self.c = worker, store, data, config
        self.stateful = config["stateful"]
        self.slowdown = config["slowdown"].get(worker, 1.0)
        self.mode = config["mode"]
        self.work = trainer.make_work(loss_fn, config["cfg"], self.mode, config["num_workers"], config["local_lr"])
        devices = jax.devices()[: config["devices_per_worker"]]
        if len(devices) < config["devices_per_worker"]:
            raise ValueError(
                f"worker {worker} sees {len(jax.devices())} device(s), needs {config['devices_per_worker']}."
            )
        self.group = trainer._Group(devices, simulator._split_key(config["key"])[2])

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
        loader = ShardLoader(self.data, worker=self.w, num_workers=c["num_workers"], batch_size=c["batch_size"],
                             key=c["key"], start_batch=position * c["n_sync"])  # fmt: skip
        return params, model_state, version, loader

    def ping(self) -> int:
        return self.w

    def warm_up(self) -> None:
        """Compiles the exchange-period function on a minibatch of this worker's, before the driver starts the clock."""
        params, model_state, version, loader = self._sync(require_ray())
        try:
            batches = trainer._stack([loader.batch(0)] * self.c["n_sync"])
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
                batches = trainer._stack([next(loader) for _ in range(c["n_sync"])])
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


def train_ray(loss_fn, rule, params, data, *, num_workers, steps, mode, batch_size, key, model_state, n_sync, push,
              local_learning_rate, devices_per_worker, out_dir, checkpoint_every, resume, eval_fn, eval_every,
              eval_device, on_worker_failure, on_nonfinite, max_restarts, ray_address, timeout, num_examples,
              shard_size, slowdown, log_every, progress):  # fmt: skip
    """The Ray backend of :func:`asgd_jax.trainer.train` (arguments already validated there)."""
    ray = require_ray()
    if not ray.is_initialized():
        ray.init(address=ray_address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    stateful = model_state is not None
    out = None if out_dir is None else os.path.abspath(os.fspath(out_dir))
    if out is not None and os.path.exists(os.path.join(out, "checkpoint.npz")) and not resume:
        raise ValueError(f"{out} already holds a checkpoint: pass resume=True (--resume) to continue that run, or "
                         "choose another output folder.")  # fmt: skip
    header = {"mode": mode, "n_sync": n_sync, "batch_size": batch_size, "push": push,
              "key": simulator._key_fingerprint(key)}  # fmt: skip
    here = ray.get_runtime_context().get_node_id()
    pin = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id=here, soft=False)
    run_id = os.urandom(4).hex()
    store = (
        ray.remote(StoreActor)
        .options(
            name=f"asgd-jax/{run_id}/store",
            num_cpus=0,
            max_concurrency=num_workers + 8,
            max_restarts=-1 if out else 0,
            max_task_retries=0,
            scheduling_strategy=pin,
        )
        .remote(
            rule,
            jax.device_get(params),
            num_workers,
            {
                "model_state": jax.device_get(model_state),
                "max_updates": steps,
                "out_dir": out,
                "on_nonfinite": on_nonfinite,
                "checkpoint_dir": out,
                "checkpoint_every": checkpoint_every,
                "resume": out is not None,
                "header": header,
                "snapshot_every": eval_every,
            },
            mode,
        )
    )
    gpus = ray.cluster_resources().get("GPU", 0) > 0
    resources = {"num_gpus": devices_per_worker} if gpus else {"num_cpus": 1}
    config = {"cfg": simulator._Config(mode, n_sync, push, batch_size, num_examples, shard_size, stateful, 1),
              "num_workers": num_workers, "local_lr": local_learning_rate, "devices_per_worker": devices_per_worker,
              "key": key, "batch_size": batch_size, "n_sync": n_sync, "stateful": stateful,
              "slowdown": slowdown, "mode": mode}  # fmt: skip
    data_ref = ray.put(data)
    Worker = ray.remote(WorkerActor)
    workers = {
        w: Worker.options(name=f"asgd-jax/{run_id}/worker-{w}", max_restarts=max_restarts, max_task_retries=0,
                          **resources).remote(w, store, loss_fn, data_ref, config)
        for w in range(num_workers)
    }  # fmt: skip
    # The driver evaluates (off the workers' GPUs by default), writes metrics.jsonl and draws the progress bar.
    metrics = trainer._Metrics(num_workers)
    evaluator = None
    if eval_fn is not None:
        evaluator = trainer._Evaluator(eval_fn, eval_device or jax.devices("cpu")[0], metrics.write)
        evaluator.warm_up(jax.device_get(params), jax.device_get(model_state))
    status = ray.get(store.status.remote())  # also waits for the store to be up (and resumed)
    for ref in [actor.warm_up.remote() for actor in workers.values()]:  # compiled before the clock starts
        try:
            ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:  # its run() fails the same way
            log.warning("a worker's warm-up failed: %s", e)
    if out is not None:
        os.makedirs(out, exist_ok=True)
    metrics.open(out, append=bool(status["resumed_from"]), applied=status["applied"], pushes=status["done"],
                 staleness_counts=status["staleness_counts"])  # fmt: skip
    start = time.perf_counter()
    metrics.restart_clock(start)
    running = {workers[w].run.remote(): w for w in workers}
    restarts = dict.fromkeys(workers, 0)
    failures: dict[int, str] = {}
    stats: dict[int, dict[str, Any]] = {}
    from tqdm.auto import tqdm

    bar = tqdm(total=steps, initial=status["applied"], disable=not progress, unit="update",
               desc=f"{mode} x{num_workers} (ray)", dynamic_ncols=True)  # fmt: skip
    losses: list[float] = []
    interrupted = False

    def take(polled) -> None:
        """Hands a poll's snapshots to the evaluator and writes a metrics record when one is due."""
        nonlocal status
        status, new_losses, snapshots = polled
        losses.extend(new_losses)
        for snapshot in snapshots if evaluator is not None else ():
            evaluator.submit(*snapshot)

    def log_record(final: bool = False) -> None:
        record = metrics.record(
            applied=status["applied"], rejected=status["rejected"], elapsed=time.perf_counter() - start,
            pushes=status["done"], new_losses=losses, staleness_counts=status["staleness_counts"], final=final,
        )  # fmt: skip
        losses.clear()
        metrics.write(record)
        bar.update(status["applied"] - bar.n)
        if record["loss"] is not None:
            bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)

    deadline = start + timeout
    next_log = start + log_every
    try:
        while running and time.perf_counter() < deadline:
            ready, _ = ray.wait(list(running), num_returns=1, timeout=min(0.25, log_every))
            for ref in ready:
                w = running.pop(ref)
                try:
                    stats[w] = _merge(stats.get(w), ray.get(ref))
                except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                    failures[w] = f"{type(e).__name__}: {e}"[:500]
                    log.error("worker %d failed: %s", w, failures[w])
                    if on_worker_failure != "stop" and restarts[w] < max_restarts and _alive(ray, workers[w]):
                        restarts[w] += 1  # Ray restarted the actor; it re-syncs from the store (in SSGD it rejoins
                        log.warning("worker %d restarted (%d of %d)", w, restarts[w], max_restarts)  # its round)
                        running[workers[w].run.remote()] = w
                    elif on_worker_failure == "stop" or mode == "sync":  # SSGD cannot go on without a worker
                        ray.get(store.close.remote())
            try:
                take(ray.get(store.progress.remote()))
            except _actor_errors(ray):  # the store is restarting from its checkpoint: poll again later
                continue
            if time.perf_counter() >= next_log:
                next_log += log_every
                log_record()
    except KeyboardInterrupt:
        interrupted = True
        log.warning("interrupted: stopping the workers and writing a final checkpoint")
    finally:
        try:
            polled, final_params, final_ms = ray.get(store.close.remote())
        finally:
            for actor in workers.values():
                ray.kill(actor)
            ray.kill(store)
            bar.close()
    seconds = time.perf_counter() - start
    take(polled)
    evals = []
    if evaluator is not None:
        evaluator.close()
        if not evaluator.history or evaluator.history[-1]["update"] != status["applied"]:
            evaluator.submit(status["applied"], final_params, final_ms)
            evaluator.close()
        evals = evaluator.history
    if out is not None:
        from asgd_jax import checkpoint

        checkpoint.save_model(os.path.join(out, trainer.MODEL), final_params, final_ms)
        log_record(final=True)
    metrics.close()
    if interrupted:
        raise KeyboardInterrupt(f"training interrupted at update {status['applied']}; resume=True continues")
    if status["error"] is not None:
        raise RuntimeError(f"training stopped: {status['error']}")
    return trainer.TrainResult(
        params=final_params,
        model_state=final_ms,
        pushes_sent=status["received"],
        pushes_applied=status["applied"],
        pushes_rejected=status["rejected"],
        pushes_late=status["late"],
        failures=failures,
        trace_path=None if out is None else os.path.join(out, "trace.jsonl"),
        checkpoint_path=None if out is None else os.path.join(out, "checkpoint.npz"),
        metrics_path=None if out is None else os.path.join(out, trainer.METRICS),
        seconds=seconds,
        losses={w: s["losses"] for w, s in stats.items()},
        workers=[trainer.WorkerStats(pushes=s["pushes"], compute=s["compute"], exchange=s["exchange"],
                                     total=s["compute"] + s["exchange"]) for s in
                 (stats.get(w, {"pushes": 0, "compute": 0.0, "exchange": 0.0}) for w in range(num_workers))],
        evals=evals,
        resumed_from=status["resumed_from"],
        staleness_counts=dict(sorted(status["staleness_counts"].items())),
    )  # fmt: skip


def _merge(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    if old is None:
        return new
    return {k: old[k] + new[k] for k in new}
