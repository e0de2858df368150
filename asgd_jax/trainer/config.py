"""A training run's settings, validated when made: :class:`TrainConfig` (its plan and how the trainer runs it)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from collections.abc import Mapping
from typing import Any

import jax

from asgd_jax import errors
from asgd_jax.plan import Plan
from asgd_jax.trainer.discipline import TRAINABLE, Discipline

__all__ = ["BACKENDS", "FAILURE_POLICIES", "NONFINITE_POLICIES", "TrainConfig"]

BACKENDS = ("threads", "ray")
FAILURE_POLICIES = ("continue", "stop")
NONFINITE_POLICIES = ("reject", "stop")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run's settings, validated when made: its :class:`asgd_jax.Plan` and how the trainer runs it.

    The plan is the run's static description, the same value the simulator reads: the worker count (``Plan(M)``, its
    delay model ``Workers(M)``: the trainer's delays are real, measured and recorded in ``trace.jsonl``; or an
    optimal-time method over M workers, ``Ringmaster(M, R, stops=)``, ``Rennala(M, S, stops=)``, ``MSync(M, m)``,
    whose ignores, stops and rounds the store and the workers carry out for real), the budget,
    the batch, the exchange pattern (``mode``, ``n_sync``, ``push``, ``local_lr``) and the cadence (``eval_every``,
    ``checkpoint_every``). Every field of the plan and of this class but ``args`` is a flag of ``asgd-jax train``
    with the same name (``--workers M`` for the plan's delays, with ``--ringmaster R``, ``--rennala S``, ``--msync m``
    and ``--stops``; ``progress=False`` is ``--no-progress``; ``--steps`` is an alias of ``--num-updates``); a TOML
    or JSON ``--config`` file uses the same names. The model, data and rule are
    :func:`asgd_jax.trainer.train`'s other arguments.

    Attributes:
      plan: the run's :class:`asgd_jax.Plan` (default: 4 workers, 2,000 updates, batch 32); ``num_updates`` counts the
        warm-up too. ``checkpoint_every`` (default a tenth of the run) needs ``out``; ``eval_every`` (default about
        a twentieth of the run) needs an ``eval_fn``: both resolved by the plan, as in the simulator.
      seed: the run's key is ``jax.random.key(seed)``: it fixes every worker's minibatch order and model randomness
        (the simulator's, for replay).
      devices_per_worker: devices per worker; worker w owns group ``w mod (devices // devices_per_worker)``, its
        minibatch is split over the group and the gradients averaged inside it.
      out: the run's folder: ``plan.json``, ``trace.jsonl``, ``metrics.jsonl``, ``checkpoint.npz``, ``model.npz``,
        ``summary.json`` (and ``args.json``, with ``args``).
      resume: ``True``: continue from ``out``'s checkpoint (one must be there); ``"auto"``: continue if there is one,
        else start; ``False``: start (an existing checkpoint is an error, never overwritten).
      warm_start_steps: first this many updates with a single worker, then all M start from its weights.
      log_every: seconds between records of ``metrics.jsonl`` (and progress-bar refreshes).
      progress: show a progress bar.
      on_worker_failure: ``"continue"`` (the others carry on) or ``"stop"``; SSGD always stops.
      on_nonfinite: a NaN/Inf push is ``"reject"``-ed (counted) or ``"stop"``-s the run.
      max_nonfinite: this many NaN/Inf pushes in a row stop the run (a diverged model; default: 10 per worker).
      slowdown: ``{worker: factor}`` makes those workers ``factor`` times slower (stragglers).
      timeout: seconds after which the run is stopped regardless.
      backend: ``"threads"`` (this machine's devices) or ``"ray"`` (actors on a Ray cluster).
      store_device: where the parameter store keeps the server state: ``"cpu"`` (the host, the default) or a device
        ``"PLATFORM[:INDEX]"`` (``"gpu"``, ``"gpu:7"``; index 0 by default; on Ray the store actor asks for one GPU
        and uses it). On the threads backend a worker hands its payload to the store as it lies on the worker's
        device, so a store on an accelerator receives pushes device to device.
      ray_address: the Ray cluster to join (``"auto"``: the one ``ray start`` made); default: a local instance.
      max_restarts: Ray: how often a dead worker actor is restarted before it is dropped.
      tensorboard: also write every record of ``metrics.jsonl`` to TensorBoard event files in ``<out>/tensorboard``
        (:mod:`asgd_jax.writers`; the optional extra ``asgd_jax[tensorboard]``).
      args: what asked for the run, JSON values (``asgd-jax train`` passes its flags; a script its own settings): kept
        in ``<out>/args.json`` from the moment the run's session takes its folder, a kill included, and in
        ``summary.json``'s ``"args"``. Nothing of the run reads them; ``asgd-jax train --out F --resume`` takes
        them as its flags' defaults (a key named as a flag is that flag's value).

    Example:
      >>> import asgd_jax
      >>> config = asgd_jax.TrainConfig(asgd_jax.Plan(4, num_updates=100), seed=1)
      >>> config.plan.workers, config.plan.n_sync
      (4, 1)
      >>> asgd_jax.TrainConfig(asgd_jax.Plan(4), seed=-1)
      Traceback (most recent call last):
      ...
      asgd_jax.errors.ConfigError: seed=-1 (--seed) is invalid: use an int >= 0.
    """

    plan: Plan = dataclasses.field(default_factory=lambda: Plan(4))
    seed: int = 0
    devices_per_worker: int = 1
    out: str | None = None
    resume: bool | str = False
    warm_start_steps: int = 0
    log_every: float = 1.0
    progress: bool = True
    on_worker_failure: str = "continue"
    on_nonfinite: str = "reject"
    max_nonfinite: int | None = None
    slowdown: Mapping[int, float] = dataclasses.field(default_factory=dict)
    timeout: float = 24 * 3600.0
    backend: str = "threads"
    store_device: str = "cpu"
    ray_address: str | None = None
    max_restarts: int = 0
    tensorboard: bool = False
    args: Mapping[str, Any] | None = None

    def __post_init__(self):
        flag = lambda name: "--" + name.replace("_", "-")
        plan = self.plan
        _check_plan(plan)
        errors.int_at_least("devices_per_worker", self.devices_per_worker, 1, flag("devices_per_worker"))
        for name in ("seed", "warm_start_steps", "max_restarts"):
            errors.int_at_least(name, getattr(self, name), 0, flag(name))
        errors.require(self.seed < 2**32, "seed", self.seed, "use an int < 2**32 (a key's seed)", "--seed")
        if self.max_nonfinite is not None:
            errors.int_at_least("max_nonfinite", self.max_nonfinite, 1, flag("max_nonfinite"))
        for name, choices in (
            ("backend", BACKENDS),
            ("on_worker_failure", FAILURE_POLICIES),
            ("on_nonfinite", NONFINITE_POLICIES),
        ):
            errors.choice(name, getattr(self, name), choices, flag(name))
        errors.finite_number("log_every", self.log_every, positive=True, flag=flag("log_every"))
        errors.finite_number("timeout", self.timeout, positive=True, flag=flag("timeout"))
        errors.require(
            self.warm_start_steps < plan.num_updates,
            "warm_start_steps",
            self.warm_start_steps,
            f"use fewer than num_updates={plan.num_updates}",
            flag("warm_start_steps"),
        )
        errors.require(
            plan.batch_size % self.devices_per_worker == 0,
            "batch_size",
            plan.batch_size,
            f"use a multiple of devices_per_worker={self.devices_per_worker}",
            flag("batch_size"),
        )
        if self.out is None:
            errors.require(
                plan.checkpoint_every is None,
                "checkpoint_every",
                plan.checkpoint_every,
                "checkpoints need an output folder: pass out (--out) too",
                flag("checkpoint_every"),
            )
            errors.require(not self.resume, "resume", self.resume, "a resume needs out (--out)", flag("resume"))
        errors.require(self.resume in (True, False, "auto"), "resume", self.resume, "use True, False or 'auto'")
        errors.require(isinstance(self.progress, bool), "progress", self.progress, "use True or False", "--progress")
        errors.require(
            isinstance(self.tensorboard, bool) and (self.out is not None or not self.tensorboard),
            "tensorboard",
            self.tensorboard,
            "use True or False; event files need an output folder (--out)",
            "--tensorboard",
        )
        errors.require(
            isinstance(self.store_device, str) and re.fullmatch(r"[a-z]+(:\d+)?", self.store_device) is not None,
            "store_device",
            self.store_device,
            "give 'cpu' (the host) or a device 'PLATFORM[:INDEX]' such as 'gpu' or 'gpu:1'",
            "--store-device",
        )
        errors.require(
            self.ray_address is None or isinstance(self.ray_address, str),
            "ray_address",
            self.ray_address,
            "give a Ray address such as 'auto' or 'host:6379', or None for a local instance",
            "--ray-address",
        )
        self._check_slowdown_and_out(plan)
        if self.args is not None:
            object.__setattr__(self, "args", _json_table(self.args))

    def _check_slowdown_and_out(self, plan: Plan) -> None:
        """The stragglers (``{worker: factor}``) and the output folder, in the forms the rest of the run reads."""
        errors.require(
            self.slowdown is None or isinstance(self.slowdown, Mapping),
            "slowdown",
            self.slowdown,
            f"give {{worker in [0, {plan.workers}): factor >= 1}}",
            "--slowdown W:F",
        )
        slowdown = dict(self.slowdown or {})
        for w, factor in slowdown.items():
            ok = isinstance(w, int) and 0 <= w < plan.workers and isinstance(factor, int | float) and factor >= 1
            errors.require(
                ok, "slowdown", slowdown, f"use {{worker in [0, {plan.workers}): factor >= 1}}", "--slowdown W:F"
            )
        object.__setattr__(self, "slowdown", slowdown)
        if self.out is not None:
            ok = isinstance(self.out, str | os.PathLike) and os.fspath(self.out) != ""
            errors.require(ok, "out", self.out, "give a folder path", "--out")
            object.__setattr__(self, "out", os.fspath(self.out))

    def replace(self, **changes: Any) -> TrainConfig:
        """A validated copy with ``changes``."""
        return dataclasses.replace(self, **changes)

    def key(self) -> jax.Array:
        """The run's key, ``jax.random.key(seed)`` (made on the default device, deliberately)."""
        with jax.transfer_guard("allow"):
            return jax.random.key(self.seed)

    @functools.cached_property
    def discipline(self) -> Discipline:
        """How this run exchanges (:class:`asgd_jax.trainer.discipline.Discipline`), derived once from the plan."""
        return Discipline.of(self.plan)

    def store_device_now(self) -> jax.Device:
        """The store's device in this process (:attr:`store_device`), or a ``ConfigError`` naming what there is."""
        platform, _, index = self.store_device.partition(":")
        try:
            found = jax.devices(platform)
        except RuntimeError:
            have = sorted({d.platform for d in jax.devices()} | {"cpu"})
            raise errors.ConfigError(
                f"store_device={self.store_device!r} (--store-device): this machine has no {platform} device "
                f"(it has: {', '.join(have)}); use 'cpu' or one of those."
            ) from None
        errors.require(
            int(index or 0) < len(found),
            "store_device",
            self.store_device,
            f"there are {len(found)} {platform} device(s): use an index below {len(found)}",
            "--store-device",
        )
        return found[int(index or 0)]

    def checkpoint_interval(self) -> int | None:
        """Updates between checkpoints with an output folder: the plan's (:meth:`asgd_jax.Plan.checkpoint_interval`)."""
        return None if self.out is None else self.plan.checkpoint_interval()

    def eval_interval(self) -> int:
        """Updates between evaluations: the plan's (:meth:`asgd_jax.Plan.eval_interval`, the simulator's too)."""
        return self.plan.eval_interval()


def _json_table(args: Any) -> dict[str, Any]:
    """``args`` as it reads back from JSON (tuples become lists), or a ``ConfigError`` for what JSON cannot hold."""
    why = "give a table of JSON values (str keys; strings, finite numbers, booleans, None, lists, tables)"
    errors.require(isinstance(args, Mapping), "args", type(args).__name__, why)
    table = {}
    for key, value in args.items():
        errors.require(isinstance(key, str), "args", f"{{{key!r}: ...}}", why)
        try:
            table[key] = json.loads(json.dumps(value, allow_nan=False))
        except (TypeError, ValueError) as e:
            raise errors.ConfigError(f"args[{key!r}]={value!r} is invalid ({e}): {why}.") from None
    return table


def _check_plan(plan: Any) -> None:
    """What of a plan the trainer runs: a Plan of M real workers (or an optimal-time method's), no virtual-time
    budget."""
    errors.require(isinstance(plan, Plan), "plan", plan, "give an asgd_jax.Plan(workers, num_updates=...)")
    errors.require(
        isinstance(plan.delays, TRAINABLE),
        "plan.delays",
        plan.delays,
        "the trainer runs M real workers: give Plan(M) (its delays are measured, not drawn), or the optimal-time "
        "methods' Ringmaster(M, R, stops=), Rennala(M, S, stops=) or MSync(M, m)",
        "--workers",
    )
    errors.require(
        plan.time_budget is None,
        "plan.time_budget",
        plan.time_budget,
        "a virtual-time budget is the simulator's: the trainer's wall-clock budget is timeout= (--timeout)",
    )
