"""Real asynchronous training: workers on devices (threads here, or actors on a Ray cluster) against a parameter store.

:func:`train` validates everything before anything compiles or starts, runs the warm start (GPU A-SGD: one worker
first, then all M from its weights) and hands the run to a backend: :mod:`asgd_jax.trainer.threads` (this machine's
devices) or :mod:`asgd_jax.trainer.ray_backend` (a Ray cluster). Both share :mod:`asgd_jax.trainer.session` and the
store's server step, so a run's ``trace.jsonl`` replays in the simulator: ``simulate(..., replay_plan(out),
key=jax.random.key(seed))`` (the plan the run recorded in ``plan.json``, its delays the recorded trace) reproduces the
final weights to float tolerance (the same minibatches and dropout masks), also across a kill and a resume.

Example:
  >>> import jax, numpy as np, jax.numpy as jnp, asgd_jax
  >>> from asgd_jax.trainer import TrainConfig, train
  >>> x = np.random.default_rng(0).normal(size=(256, 3)).astype(np.float32)
  >>> data = {"x": x, "y": x @ np.array([1.0, -2.0, 0.5], np.float32)}
  >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
  >>> config = TrainConfig(asgd_jax.Plan(2, num_updates=200, batch_size=16), progress=False)
  >>> result = train(loss, asgd_jax.asgd(0.1), np.zeros(3, np.float32), data, config, devices=jax.devices()[:2])
  >>> result.pushes_applied, np.round(result.params, 1).tolist()
  (200, [1.0, -2.0, 0.5])
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from asgd_jax import checkpoint, delays, errors, exchange, interrupts, partition, recipes, rules
from asgd_jax import loss as loss_lib
from asgd_jax.plan import Plan
from asgd_jax.trainer import session
from asgd_jax.trainer.config import TrainConfig
from asgd_jax.trainer.persistence import check_resume
from asgd_jax.trainer.session import TrainResult
from asgd_jax.trainer.worker import device_groups

__all__ = ["ARGS", "PLAN", "replay_plan", "train"]

PLAN = "plan.json"
ARGS = "args.json"  # TrainConfig.args: what asked for the run (asgd-jax train's flags), from the run's start

log = logging.getLogger("asgd_jax.trainer")


def train(
    loss_fn: Callable | loss_lib.Loss,
    rule: optax.GradientTransformation,
    params: Any,
    data: Any,
    config: TrainConfig | None = None,
    *,
    model_state: Any = None,
    has_aux: bool = False,
    eval_fn: Callable | None = None,
    devices: list[jax.Device] | None = None,
    eval_device: jax.Device | None = None,
    on_metrics: Callable[[dict[str, Any]], Any] | None = None,
) -> TrainResult:
    """Trains with ``config.plan.workers`` asynchronous workers against a parameter store.

    Args:
      loss_fn, rule, params, data, model_state, has_aux: as in :func:`asgd_jax.simulate` (``data`` stays on the
        host: workers stream their shards).
      config: the run's settings (:class:`TrainConfig`; default ``TrainConfig()``).
      eval_fn: ``eval_fn(params, model_state) -> dict`` on the server's weights every ``config.eval_interval()``
        updates, on ``eval_device`` in a thread of its own (workers never wait for it), and once at the end.
      devices: threads backend: the devices to spread the workers over (default: all of ``jax.devices()``).
      eval_device: where evaluations run (default: a device no worker uses, else the last; on Ray the driver's CPU).
      on_metrics: called with every record of ``metrics.jsonl`` as it is written (training, evaluation, final; also
        without ``out``), in the driver's process; an exception it raises stops the run as a full disk does.

    Raises:
      ValueError: a bad argument (:class:`asgd_jax.errors.ConfigError`), before anything compiles or starts.
      KeyboardInterrupt: after Ctrl-C, once the final checkpoint is written (``resume=True`` continues).
      RuntimeError: when the store stopped the run (``on_nonfinite="stop"``).
    """
    config = TrainConfig() if config is None else config
    errors.require(isinstance(config, TrainConfig), "config", config, "pass an asgd_jax.trainer.TrainConfig")
    errors.require(on_metrics is None or callable(on_metrics), "on_metrics", on_metrics, "give a function of a record")
    if config.tensorboard:
        from asgd_jax import writers

        writers.TensorBoard.check()  # the optional extra is there, before anything starts
    loss = loss_lib.as_loss(loss_fn, has_model_state=model_state is not None, has_aux=has_aux)
    plan = config.plan
    if plan.eval_every is not None and eval_fn is None:
        raise errors.ConfigError("eval_every was given without eval_fn: pass eval_fn(params, model_state) -> dict.")
    ex = exchange.validate(loss, data, params, model_state, plan)
    assignment = partition.assignment(plan.partition, data, plan.workers, plan.batch_size)  # the simulator's draw
    devices = list(devices or jax.devices())
    if config.backend == "threads":
        device_groups(devices, config.devices_per_worker)  # fails now, not after the warm start
        config.store_device_now()
    else:
        from asgd_jax.ray_cluster import require_ray

        require_ray()  # fails at once, with the install command
    lock = contextlib.nullcontext() if config.out is None else session.RunLock(config.out)  # one run per folder
    with interrupts.watch(), lock:
        run = _Run(ex, assignment, devices, eval_device, on_metrics)
        return _start(loss, rule, params, data, config, model_state, eval_fn, run)


class _Run(NamedTuple):
    """What :func:`train` decided before the run's folder was its own: the exchange, the partition's assignment, the
    devices and the metrics' listener."""

    ex: exchange.Exchange
    assignment: Any
    devices: list
    eval_device: Any
    on_metrics: Any


def _start(loss, rule, params, data, config: TrainConfig, model_state, eval_fn, run: _Run) -> TrainResult:
    """The run, once its folder is this process's: the resume decision and checks, the warm start, the backend."""
    plan = config.plan
    config = config.replace(resume=_resume_decision(config))
    # Everything that changes the weights: a resume with any of it different is refused (the trace would not replay).
    header = {
        "num_workers": plan.workers,
        "mode": run.ex.mode,
        "n_sync": run.ex.n_sync,
        "batch_size": run.ex.batch_size,
        "push": run.ex.push,
        "key": exchange.key_fingerprint(config.key()),
        "local_lr": plan.local_lr,
        "devices_per_worker": config.devices_per_worker,
        "rule_probe": rules.fingerprint(rule, params),
        "data": _data_fingerprint(data),
        # What a probe of the rule cannot see (a schedule's later steps) and what the loss computes (the model, its
        # dtype, the augmentation), as stable text; and the warm start's length. Checkpoints before 2026-12-03 lack
        # these keys: they are not checked there (persistence.ADDED_LATER).
        "recipe": recipes.describe(rule),
        "loss": recipes.describe(loss.fn),
        "warm_start_steps": config.warm_start_steps,
        "partition": str(plan.partition),
    }
    header.update(config.discipline.header())  # (keys only such runs have: older checkpoints still resume)
    if config.resume and config.out is not None and os.path.exists(os.path.join(config.out, session.CHECKPOINT)):
        # A stale checkpoint or trace is refused here, before anything starts; one from before 2026-12-05 holds the
        # rule's probe as it was computed then.
        check_resume(config.out, header, {"rule": lambda: rules.fingerprint(rule, params, eager=True)})
    if config.out is not None:  # the folder is this run's now: what asked for it and its plan, kept before anything
        if config.args is not None:
            _write_at_start(os.path.join(config.out, ARGS), config.args)
        _record_plan(config.out, plan)
    params, model_state = _warm_start(loss, rule, params, data, config, model_state, run.devices)
    main = config.replace(plan=plan.replace(num_updates=plan.num_updates - config.warm_start_steps), warm_start_steps=0)
    kwargs = dict(
        ex=run.ex,
        model_state=model_state,
        eval_fn=eval_fn,
        eval_device=run.eval_device,
        header=header,
        on_metrics=run.on_metrics,
        assignment=run.assignment,
    )
    if config.backend == "ray":
        from asgd_jax.trainer import ray_backend

        return ray_backend.run(loss, rule, params, data, main, **kwargs)
    from asgd_jax.trainer import threads

    return threads.run(loss, rule, params, data, main, devices=run.devices, **kwargs)


def _warm_start(loss, rule, params, data, config: TrainConfig, model_state, devices) -> tuple[Any, Any]:
    """GPU A-SGD's warm start: ``warm_start_steps`` updates with a single worker (in ``<out>/warmup``), whose weights
    every worker then starts from; skipped when resuming a run that is past it."""
    if not config.warm_start_steps:
        return params, model_state
    main_checkpoint = None if config.out is None else os.path.join(config.out, session.CHECKPOINT)
    if config.resume and main_checkpoint is not None and os.path.exists(main_checkpoint):
        return params, model_state
    warm_config = config.replace(
        # (one worker on the whole data, as GPU A-SGD's warm start: a partition is the main run's)
        plan=config.plan.replace(delays=1, num_updates=config.warm_start_steps, eval_every=None, partition=None),
        warm_start_steps=0,
        slowdown={},
        out=None if config.out is None else os.path.join(config.out, "warmup"),
        resume="auto" if config.resume else False,
        args=None,
    )
    warm = train(loss, rule, params, data, warm_config, model_state=model_state, devices=devices)
    return warm.params, (warm.model_state if model_state is not None else None)


def _record_plan(out: str, plan: Plan) -> None:
    """Writes the run's plan to ``plan.json`` (atomically): what :func:`replay_plan` reads back."""
    record = {"workers": plan.workers, **{k: v for k, v in plan.describe().items() if k not in ("delays", "workers")}}
    _write_at_start(os.path.join(out, PLAN), record)


def _write_at_start(path: str, record: Any) -> None:
    """A record of the run written before its workers start; a failed write (a full disk) stops it there, in one
    :class:`~asgd_jax.errors.RunStopped` (the atomic write leaves an earlier record whole)."""
    try:
        checkpoint.write_json(path, record)
    except OSError as e:
        raise errors.RunStopped(
            f"{errors.write_failure(e)}: {path} could not be written, and the run did not start; free some space and "
            "start it again (a resume's checkpoint is as it was)"
        ) from e


def replay_plan(out: str | os.PathLike, num_updates: int | None = None) -> Plan:
    """The :class:`asgd_jax.Plan` that replays the trainer run in ``out`` in the simulator: the run's recorded plan with
    its delays the recorded ``trace.jsonl`` (:meth:`asgd_jax.delays.Trace.load`) and its budget the trace's length (or
    ``num_updates``).

    Example (after ``asgd-jax train --out runs/x``)::

        plan = asgd_jax.trainer.replay_plan("runs/x")
        replayed = asgd_jax.simulate(loss, rule, params, data, plan, key=jax.random.key(seed))
    """
    out = os.fspath(out)
    record = checkpoint.read_json(os.path.join(out, PLAN))
    errors.require(isinstance(record, dict), "out", out, f"its {PLAN} is not a trainer's plan record")
    # (a DyLU run's record holds each worker's minibatches per period: its "local_steps")
    trace = delays.Trace.load(
        os.path.join(out, session.TRACE), num=record.get("workers"), steps=record.get("local_steps")
    )
    keys = ("batch_size", "mode", "n_sync", "push", "local_lr", "inner", "partition")  # ("inner": since 2026-12-04)
    fields = {k: record[k] for k in keys if k in record}
    return Plan(trace, num_updates=num_updates or len(trace), **fields)


def _resume_decision(config: TrainConfig) -> bool:
    """Turns ``resume`` into a yes or no (the folder is the run's: :class:`asgd_jax.trainer.session.RunLock`): the one
    place a run's resume is decided, for every backend."""
    if config.out is None:
        return False
    exists = os.path.exists(os.path.join(config.out, session.CHECKPOINT))
    warming = os.path.exists(os.path.join(config.out, "warmup", session.CHECKPOINT))  # killed in the warm start
    if config.resume is True and not exists and not warming:
        raise errors.ConfigError(
            f"resume=True (--resume) but {config.out} holds no checkpoint: check --out, or pass --resume auto to start "
            "a fresh run when there is none."
        )
    if not config.resume and exists:  # never overwritten silently
        raise errors.ConfigError(
            f"out={config.out!r} (--out) already holds a checkpoint: pass resume=True (--resume) to continue that run, "
            "or choose another output folder."
        )
    # (auto: a run killed in its warm start goes on from the warm start's checkpoint, as resume=True does)
    return (exists or warming) if config.resume == "auto" else bool(config.resume)


def _data_fingerprint(data: Any) -> str:
    """A short hash of the training data's shapes, dtypes and a few rows (a resume on other data is refused)."""
    import hashlib

    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(data):
        leaf = np.asarray(leaf)
        digest.update(f"{leaf.shape}{leaf.dtype}".encode())
        digest.update(np.ascontiguousarray(leaf[:4]).tobytes() + np.ascontiguousarray(leaf[-4:]).tobytes())
    return digest.hexdigest()[:16]
