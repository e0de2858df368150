"""``asgd-jax train``: real asynchronous training, workers on the devices JAX sees (or on Ray), a host-side parameter
store. Its flags build a :class:`asgd_jax.setups.Setup` (the model, the data, the schedule), the rule, a
:class:`asgd_jax.plan.Plan` and a :class:`asgd_jax.trainer.TrainConfig`; ``--config`` reads a setup file
(:mod:`asgd_jax.configs`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from asgd_jax import errors
from asgd_jax.cli.flags import Defaults, dataset_help
from asgd_jax.configs import resume_flag as _resume_flag
from asgd_jax.configs import shipped_configs
from asgd_jax.configs import table as _table

__all__ = [
    "CHANCE_MARGIN",
    "MODEL_FLAGS",
    "PLAN_FLAGS",
    "SETUP_FLAGS",
    "add_train",
    "at_chance",
    "keep_the_driver_on_the_cpu",
    "setup_of",
    "train_config",
    "train_rule",
]


# The flags that build the model, the data and the rule (a Setup, and the rule's own numbers); every other flag of
# `train` is a TrainConfig field.
SETUP_FLAGS = (
    "dataset",
    "data_dir",
    "model",
    "model_options",
    "dtype",
    "lr",
    "schedule",
    "decay_at",
    "decay_factor",
    "warmup",
    "unit",
    "momentum",
    "weight_decay",
    "augment",
    "eval_crop",
    "eval_multi_crop",
)


MODEL_FLAGS = ("config", *SETUP_FLAGS, "rule", "lam", "warm_start")


def _add_method_flags(a) -> None:
    """``train``'s flags of the optimal-time methods (Plan(delays.Ringmaster / Rennala / MSync) from Python)."""
    a(
        "--ringmaster",
        type=int,
        default=None,
        metavar="R",
        help="Ringmaster ASGD (Maranjyan et al. 2025): ignore a push R or more updates stale [off]",
    )
    a(
        "--rennala",
        type=int,
        default=None,
        metavar="S",
        help="Rennala SGD (Tyurin & Richtarik 2023): each update the mean of the first S gradients at w_t [off]",
    )
    a(
        "--msync",
        type=int,
        default=None,
        metavar="m",
        help="m-Synchronous SGD (Begunov & Tyurin 2026): the first m of the M workers' gradients, the rest stopped",
    )
    a("--stops", action="store_true", help="with --ringmaster: stop a computation R stale; --rennala: at round ends")
    a(
        "--dylu",
        type=_speeds,
        default=None,
        metavar="V1,V2,...",
        help="DyLU (Liu et al. 2024): worker w takes floor(v_w / max v * n_sync) of the local steps, v the workers' "
        "relative speeds, one per worker [off]",
    )


def _speeds(text: str) -> tuple[float, ...]:
    """``--dylu``'s comma-separated speeds."""
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not speeds: give numbers separated by commas, 1,0.5,0.25"
        ) from None


def _add_partition_flag(a, default) -> None:
    from asgd_jax.partition import KINDS

    a(
        "--partition",
        type=_partition,
        default=default,
        metavar="KIND[:VALUE[:SEED]]",
        help=f"how the data is split among the workers, one of {', '.join(KINDS)} (dirichlet:0.1, labels:2, "
        "unequal:0.5; a partition other than iid is drawn once from its seed and the labels)",
    )


def add_train(sub) -> None:
    from asgd_jax import models, rules, setups
    from asgd_jax.plan import INNER, MODES, PUSHES
    from asgd_jax.trainer.config import FAILURE_POLICIES, NONFINITE_POLICIES, TrainConfig

    d, ds = TrainConfig(), setups.Setup()
    dp = d.plan
    p = sub.add_parser(
        "train",
        help="asynchronous training on the devices JAX sees (GPUs, or fake CPU devices), or on Ray",
        description=(
            "Worker threads (worker w on device group w mod #groups) push to a host-side parameter store that "
            "applies the rule with the simulator's server step. Writes trace.jsonl (replayable with "
            "asgd_jax.delays.Trace.load), metrics.jsonl, checkpoint.npz, model.npz, args.json (the flags) and "
            "summary.json into --out. Ctrl-C writes a final checkpoint; --resume continues, with the run's flags. "
            "--config FILE (TOML or JSON, keys are the flag "
            "names) replaces flags; flags given on the command line win. --config NAME runs a setup that ships "
            f"with asgd_jax ({', '.join(shipped_configs())}): the paper's run."
        ),
        formatter_class=Defaults,
    )
    actions: list[argparse.Action] = []
    a = lambda *names, **kw: actions.append(p.add_argument(*names, **kw))
    a("--config", default=None, help="TOML or JSON file of flag values (e.g. workers = 4), or a shipped setup's name")
    a("--dataset", default=ds.dataset, help=dataset_help())
    a("--data-dir", default=ds.data_dir, help="TFDS data directory")
    a("--model", default=ds.model, choices=models.names(), help="the model, by name")
    a("--model-options", type=_table, default=ds.model_options, help="model options as JSON, e.g. '{\"width\": 0.25}'")
    a("--dtype", default=ds.dtype, choices=setups.DTYPES, help="bfloat16: compute in bf16, float32 weights")
    a("--rule", default="dc_asgd_a", choices=rules.names(), help="the server's update rule")
    a("--lr", type=float, default=ds.learning_rate, help="the server's (peak) learning rate")
    a("--schedule", default=ds.schedule, choices=setups.SCHEDULES, help="the learning rate's schedule")
    a("--decay-at", nargs="+", type=float, default=list(ds.decay_at), help="step decays, in --unit")
    a("--decay-factor", type=float, default=ds.decay_factor, help="step factor, or cosine's final fraction")
    a("--warmup", type=float, default=ds.warmup, help="linear warm-up, in --unit")
    a("--unit", default=ds.unit, choices=setups.UNITS, help="what --decay-at and --warmup count")
    a("--lam", type=float, default=None, help="DC-ASGD lambda_0 [the rule's: 0.04 for -c, 2 for -a]")
    a("--momentum", type=float, default=ds.momentum, help="momentum of the rule [none]")
    a("--weight-decay", type=float, default=ds.weight_decay, help="L2 weight decay, chained before the rule")
    a("--augment", action=argparse.BooleanOptionalAction, default=ds.augment, help="random crop and flip")
    a("--eval-crop", type=int, default=ds.eval_crop, help="evaluate on the central N x N crop")
    a("--eval-multi-crop", action=argparse.BooleanOptionalAction, default=ds.eval_multi_crop, help="average ten crops")
    a("--warm-start", default=None, metavar="MODEL", help="start from a saved model.npz (or a run folder)")
    a("--workers", type=int, default=dp.workers, help="M workers")
    _add_method_flags(a)
    a("--num-updates", "--steps", type=int, default=dp.num_updates, help="server updates, warm-up included")
    a("--batch-size", type=int, default=dp.batch_size, help="minibatch per worker")
    a("--seed", type=int, default=d.seed, help="the run's key (data order, model randomness) and initial weights")
    a("--mode", default=dp.mode, choices=MODES, help="sync: the SSGD baseline, same devices")
    a("--n-sync", type=int, default=dp.n_sync, help="minibatches between exchanges (GPU A-SGD)")
    a("--push", default=dp.push, choices=PUSHES, help="what --n-sync > 1 pushes")
    a("--local-lr", type=float, default=dp.local_lr, help="local step size when --n-sync > 1 [none]")
    a("--inner", default=dp.inner, choices=INNER, help="each worker's optimizer of its local steps, at --local-lr")
    _add_partition_flag(a, dp.partition)
    a("--devices-per-worker", type=int, default=d.devices_per_worker, help="devices per worker (batch split)")
    a("--out", default="runs/train", help="the run's folder")
    a("--checkpoint-every", type=int, default=dp.checkpoint_every, help="updates between checkpoints [a tenth]")
    a(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        type=_resume_flag,
        help="continue from --out's checkpoint (which must be there) with the run's own flags (its args.json; flags "
        "given here win); --resume auto: continue if there is one",
    )
    a("--warm-start-steps", type=int, default=d.warm_start_steps, help="first K updates with a single worker")
    a("--eval-every", type=int, default=dp.eval_every, help="updates between evaluations [about a twentieth]")
    a("--log-every", type=float, default=d.log_every, help="seconds between records of metrics.jsonl")
    a("--progress", action=argparse.BooleanOptionalAction, default=d.progress, help="a progress bar")
    a("--on-worker-failure", default=d.on_worker_failure, choices=FAILURE_POLICIES, help="a dead worker")
    a("--on-nonfinite", default=d.on_nonfinite, choices=NONFINITE_POLICIES, help="NaN/Inf pushes")
    a("--max-nonfinite", type=int, default=d.max_nonfinite, help="NaN/Inf pushes in a row that stop the run [10 x M]")
    a("--slowdown", nargs="+", default=None, metavar="W:F", help="straggler study: worker W F times slower")
    a("--timeout", type=float, default=d.timeout, help="seconds before the run is stopped")
    _add_where_flags(a, d)
    p.set_defaults(func=_train, parser=p, actions=actions, flags_of_run=flags_of_run)


def _add_where_flags(a, d) -> None:
    """``train``'s flags of where the run's parts live: the backend, the Ray cluster, the store's device, the event
    files."""
    from asgd_jax.trainer.config import BACKENDS

    a("--backend", default=d.backend, choices=BACKENDS, help="ray: actors on a Ray cluster")
    a("--ray-address", default=d.ray_address, help="Ray cluster to join ('auto': the local `ray start`)")
    a("--store-device", default=d.store_device, help="where the store's state lives: cpu or PLATFORM[:INDEX] [cpu]")
    a("--max-restarts", type=int, default=d.max_restarts, help="Ray: restarts of a dead worker actor")
    a(
        "--tensorboard",
        action=argparse.BooleanOptionalAction,
        default=d.tensorboard,
        help="also write TensorBoard event files into --out/tensorboard (pip install 'asgd_jax[tensorboard]')",
    )


def _parse_slowdown(values: Sequence[str] | None) -> dict[int, float]:
    out = {}
    for v in values or ():
        try:
            w, f = v.split(":")
            out[int(w)] = float(f)
        except ValueError:
            raise errors.ConfigError(f"--slowdown {v!r} is invalid: use WORKER:FACTOR, e.g. 0:4") from None
    return out


# The Plan fields that are flags of `train` under their own names (its delays are --workers M; chunk is the
# simulator's alone).
PLAN_FLAGS = (
    "num_updates",
    "batch_size",
    "mode",
    "n_sync",
    "push",
    "local_lr",
    "inner",
    "partition",
    "eval_every",
    "checkpoint_every",
)


def _partition(text: str):
    """``--partition``'s value (argparse reports a bad one with the library's own message)."""
    from asgd_jax.partition import Partition

    try:
        return Partition.parse(text)
    except errors.ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def train_config(args: argparse.Namespace):
    """The run's :class:`asgd_jax.trainer.TrainConfig`, its :class:`asgd_jax.plan.Plan` within, from the flags
    (validated: every flag named)."""
    from asgd_jax import delays
    from asgd_jax.plan import Plan
    from asgd_jax.trainer.config import TrainConfig

    methods = {"--ringmaster": args.ringmaster, "--rennala": args.rennala, "--msync": args.msync, "--dylu": args.dylu}
    given = [flag for flag, value in methods.items() if value is not None]
    errors.require(
        len(given) <= 1, "method", " and ".join(given), "choose one of --ringmaster, --rennala, --msync, --dylu"
    )
    errors.require(
        not args.stops or given[:1] in (["--ringmaster"], ["--rennala"]), "stops", True, "add --ringmaster R", "--stops"
    )
    workers = args.workers
    if args.ringmaster is not None:
        workers = delays.Ringmaster(args.workers, args.ringmaster, args.stops)
    elif args.rennala is not None:
        workers = delays.Rennala(args.workers, args.rennala, args.stops)
    elif args.msync is not None:
        workers = delays.MSync(args.workers, args.msync)
    elif args.dylu is not None:
        speeds = ",".join(f"{v:g}" for v in args.dylu)
        errors.require(
            len(args.dylu) == args.workers, "dylu", speeds, f"give {args.workers} speeds, one per worker", "--dylu"
        )
        workers = delays.Workers(args.workers, speeds=args.dylu, dylu=True)
    plan = Plan(workers, **{name: getattr(args, name) for name in PLAN_FLAGS})
    skip = ("plan", "slowdown", "args")
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig) if f.name not in skip}
    return TrainConfig(plan, **values, slowdown=_parse_slowdown(args.slowdown))


MACHINE_FLAGS = ("data_dir", "ray_address")
"""Flags of the machine a session runs on (where the data lies, which cluster): a resume gives them again."""
SESSION_FLAGS = ("config", "resume", "out", "timeout", "progress", *MACHINE_FLAGS)
"""The flags of one session of a run, not of the run: ``--resume`` takes every other flag from the run's record."""


def run_flags(args: argparse.Namespace) -> dict[str, Any]:
    """Every ``train`` flag's value, as JSON holds it (``--partition`` as its text): the run's record, ``args.json``."""
    values = {a.dest: getattr(args, a.dest) for a in args.actions if a.dest != "help"}
    return json.loads(json.dumps(values, default=str))


def flags_of_run(out: str) -> tuple[dict[str, Any], str] | None:
    """The flags that started the run in ``out`` (its ``args.json``, or an older run's ``summary.json``), less those
    of a session (:data:`SESSION_FLAGS`), and the file they came from; None when ``out`` has neither."""
    from asgd_jax import checkpoint
    from asgd_jax.trainer import ARGS
    from asgd_jax.trainer.session import SUMMARY

    for name in (ARGS, SUMMARY):
        path = os.path.join(out, name)
        if os.path.exists(path):
            record = checkpoint.read_json(path)
            flags = record.get("args") if name == SUMMARY and isinstance(record, dict) else record
            if name == SUMMARY and flags is None:  # a run of the Python API, or from before the record: none
                return None
            if not isinstance(flags, dict):
                raise errors.ConfigError(
                    f"--resume: {path} holds no table of flags: resume with the run's flags given."
                )
            return {k: v for k, v in flags.items() if k not in SESSION_FLAGS}, path
    return None


def keep_the_driver_on_the_cpu() -> None:
    """Ray: the driver (data, initial weights, evaluation) stays on the CPU. The worker actors own the GPUs, and a
    driver on GPU 0 would take most of its memory (JAX preallocates) from the worker placed there. Only possible before
    JAX starts its backends (it has not, in the CLI); a JAX without this private probe just keeps its default."""
    import jax

    try:  # JAX's private probe, guarded: there is no public way to ask whether its backends have started
        from jax._src import xla_bridge  # noqa: PLC2701

        started = xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):
        return
    if not started:
        jax.config.update("jax_platforms", "cpu")


def setup_of(args: argparse.Namespace):
    """The run's :class:`asgd_jax.setups.Setup` from the flags (validated: every flag named)."""
    from asgd_jax.setups import Setup

    values = {name: getattr(args, name) for name in SETUP_FLAGS if name != "lr"}
    values["decay_at"] = tuple(values["decay_at"])
    return Setup(**values, learning_rate=args.lr, batch_size=args.batch_size)


def train_rule(args: argparse.Namespace, setup: Any, plan: Any, num_examples: int | None = None):
    """The server's rule from the flags: the registered ``--rule`` with its numbers, the setup's schedule (in updates
    of this plan: an update is ``n_sync`` minibatches, or M of them in SSGD), momentum and weight decay. The same
    construction as a study's arms (:meth:`asgd_jax.setups.Setup.rule`)."""
    from asgd_jax import rules

    takes = rules.defaults(args.rule)
    why = "Malenia SGD needs its cluster (every computation stopped when a round closes), the simulator's alone"
    errors.require(args.rule != "malenia", "--rule", args.rule, f"{why}: use ringleader or ia2sgd on the trainer")
    hp = {"lam": args.lam, "momentum": args.momentum}
    errors.require(
        all(k in takes for k, v in hp.items() if v is not None),
        "--rule",
        args.rule,
        f"it takes {', '.join(takes) or 'no hyperparameters'} (drop --lam / --momentum)",
    )
    if "num_workers" in rules.required(args.rule):
        hp["num_workers"] = plan.workers
    per_update = plan.batch_size * plan.n_sync * plan.payloads
    per_epoch = (num_examples or per_update) / per_update
    hp.pop("momentum")  # the setup's (the same flag)
    return setup.rule(args.rule, setup.learning_rate_schedule(plan.num_updates, per_epoch), **hp)


def _train(args: argparse.Namespace) -> int:
    config = train_config(args)  # every flag checked before anything loads
    setup = setup_of(args)
    train_rule(args, setup, config.plan)  # the rule's flags too (the schedule is made again once the data is known)
    config = config.replace(args=run_flags(args))  # every flag checked: the run's record of them (args.json)
    if config.backend == "ray":
        keep_the_driver_on_the_cpu()
    if getattr(args, "flags_from", None):
        print(f"asgd-jax train: --resume with the run's flags from {args.flags_from} (flags given here win)")
    print(f"asgd-jax train: loading {args.dataset} and building {args.model}...", flush=True)
    import jax

    from asgd_jax import checkpoint, data, trainer
    from asgd_jax.trainer import session

    ds = data.load(setup.dataset, data_dir=setup.data_dir)
    model = setup.build_model(ds.num_classes, ds.input_shape)
    loss = setup.loss(model)  # (an augmentation that cannot fit these inputs is refused here)
    evaluation = setup.evaluation(model, ds.test)  # (and a crop larger than the images)
    if setup.augment:
        print(f"asgd-jax train: --augment on {setup.dataset}: {setup.augmentation(ds.input_shape).describe()}")
    rule = train_rule(args, setup, config.plan, len(ds.y_train))
    params, model_state = model.init(jax.random.key(args.seed))
    if args.warm_start:
        params, model_state = checkpoint.load_model(args.warm_start, params, model_state)
    where = (
        f"worker actors on Ray ({config.ray_address or 'a local instance'})"
        if config.backend == "ray"
        else f"workers on {jax.device_count()} {jax.devices()[0].platform} device(s)"
    )
    print(
        f"asgd-jax train: {config.plan.workers} {config.plan.mode} {where}, {args.rule}, {config.plan.num_updates} "
        f"updates -> "
        f"{config.out}; compiling...",
        flush=True,
    )
    try:
        result = trainer.train(
            loss,
            rule,
            params,
            ds.train,
            config,
            model_state=model_state,
            eval_fn=evaluation,
        )
    except KeyboardInterrupt as e:
        if os.path.exists(os.path.join(config.out, session.CHECKPOINT)):
            said = str(e).removesuffix(f"; {session.RESUME_ADVICE}") or "interrupted"  # (said below, in flags)
            print(f"asgd-jax: {said} (checkpoint in {config.out}; {_resume_command(args)})", file=sys.stderr)
        else:
            print("asgd-jax: interrupted before the first checkpoint: nothing to resume", file=sys.stderr)
        return 130
    except errors.RunStopped as e:
        saved = os.path.exists(os.path.join(config.out, session.CHECKPOINT))
        kept = "The last good checkpoint and" if saved else "No checkpoint had been written yet;"
        print(f"asgd-jax: {e}. {kept} summary.json {'are' if saved else 'is'} in {config.out}.", file=sys.stderr)
        return 1
    return _report(result, config, ds.num_classes, args.lr)


def _resume_command(args: argparse.Namespace) -> str:
    """The command that continues ``args``'s run: its folder, and the machine's flags (:data:`MACHINE_FLAGS`, which a
    resume does not take from the run's record) where they were given."""
    import shlex

    words = ["asgd-jax", "train", "--out", args.out, "--resume"]
    for name in MACHINE_FLAGS:
        if getattr(args, name, None) is not None:
            words += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return f"`{shlex.join(words)}` continues it, with the run's flags"


def _report(result: Any, config: Any, num_classes: int, lr: float) -> int:
    """The finished run's line (its test error, pushes and rate), a word when the model learned nothing, and the exit
    code: 0, 1 (a worker failed) or 3 (stopped by ``--timeout``)."""
    error = f"{100 * result.evals[-1]['error']:.2f}%" if result.evals else "n/a"
    if result.evals and "perplexity" in result.evals[-1]:  # a language model: per token, and its perplexity
        error += f" per token, perplexity {result.evals[-1]['perplexity']:.3f}"
    late = f", of which {result.pushes_late} arrived after the last update" if result.pushes_late else ""
    stopped = sum(w.stopped for w in result.workers)
    late += f", ignored {result.pushes_ignored} (too stale)" if result.pushes_ignored else ""
    late += f", computations stopped {stopped}" if stopped else ""
    print(
        f"test error {error} | pushes sent {result.pushes_sent}, applied {result.pushes_applied}, "
        f"rejected {result.pushes_rejected}{late} | {result.updates_per_second:.0f} updates/s | "
        f"trace: {result.trace_path}"
    )
    last = result.evals[-1] if result.evals else {}
    finished = result.ended != "timeout" and not result.failures  # (else that is the news, not the learning rate)
    if finished and "error" in last and "perplexity" not in last and at_chance(last["error"], num_classes):
        _say_at_chance(result.pushes_applied, error, num_classes, lr, config.plan.workers)
    if result.ended == "timeout":
        print(
            f"asgd-jax: stopped by --timeout {config.timeout:g} s after {result.pushes_applied} of "
            f"{config.plan.num_updates} updates; --resume continues",
            file=sys.stderr,
        )
        return 3
    return 0 if not result.failures else 1


def _say_at_chance(updates: int, error: str, num_classes: int, lr: float, workers: int) -> None:
    if lr == 0:
        advice = " The learning rate is 0: nothing moved."
    elif workers > 1:
        advice = (
            " Asynchronous workers add staleness, and a learning rate tuned for one worker can stall or kill a "
            f"network with more: try a lower --lr ({lr:g} here) or fewer --workers ({workers} here)."
        )
    else:
        advice = f" Try a lower --lr ({lr:g} here)."
    print(
        f"asgd-jax: after {updates} updates the test error ({error}) is at chance for {num_classes} classes "
        f"({100 * (1 - 1 / num_classes):.1f}%): the model has not learned.{advice}",
        file=sys.stderr,
    )


CHANCE_MARGIN = 0.02  # (a test error within two points of guessing: a model that predicts one class, or noise)


def at_chance(error: float, num_classes: int) -> bool:
    """Whether a classifier's test ``error`` is no better than guessing among ``num_classes`` (within
    :data:`CHANCE_MARGIN`): what ``asgd-jax train`` warns of when a run ends (a network that stalled or collapsed to
    one class under stale updates ends there without a NaN to stop it). Chance is that of balanced classes (the
    shipped datasets'): on a test set where one class dominates, a model that always predicts it does better.

    Example:
      >>> at_chance(0.922, 10), at_chance(0.5, 10), at_chance(0.49, 2)
      (True, False, True)
    """
    return error >= 1 - 1 / num_classes - CHANCE_MARGIN
