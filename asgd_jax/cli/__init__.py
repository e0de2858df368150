"""The ``asgd-jax`` command line.

Subcommands:
  ablate         DC-ASGD's Table 1 in miniature (the ``dcasgd_table1`` study with flags), in the simulator.
  data prepare   download and prepare a TFDS dataset once (the only command that downloads).
  train          real asynchronous training: workers on the devices JAX sees (or on Ray), a host-side parameter store.
  run            a reproduction study (one of asgd_jax.experiments, or a study file), in the simulator.
  report         a Markdown report of a results folder.

A mistake in the input (:class:`asgd_jax.errors.ConfigError`) is reported in one line with exit status 2; anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from asgd_jax import errors

__all__ = ["build_parser", "load_config", "main"]

Defaults = argparse.ArgumentDefaultsHelpFormatter


# --------------------------------------------------------------------------------------------------------------------
# asgd-jax ablate
# --------------------------------------------------------------------------------------------------------------------


def _add_ablate(sub) -> None:
    from asgd_jax.experiments._dcasgd import ALGORITHMS

    p = sub.add_parser(
        "ablate",
        help="staleness ablation in the simulator: SGD/ASGD/SSGD/DC-ASGD-c/DC-ASGD-a x workers x seeds",
        description=(
            "Runs {SGD (M=1), ASGD, SSGD, DC-ASGD-c, DC-ASGD-a} x workers x seeds in the deterministic simulator (the "
            "dcasgd_table1 study's ablate form), prints final test error (mean ± std over seeds) laid out like "
            "DC-ASGD's Table 1, and writes results.json, results.csv, table.md and curves.png into --out."
        ),
        formatter_class=Defaults,
    )
    p.add_argument("--quick", action="store_true", help="3 seeds and 15 epochs instead of 5 and 40 (~1 min on 2 cores)")
    p.add_argument("--out", default="results/ablation", help="output folder")
    p.add_argument("--dataset", default="mnist1d", help="mnist1d, digits or tfds:<name> (e.g. tfds:cifar10)")
    p.add_argument("--data-dir", default=None, help="TFDS data directory [$TFDS_DATA_DIR or ~/tensorflow_datasets]")
    p.add_argument("--model", default="mlp", help="model: mlp, cnn, resnet20, ...")
    p.add_argument("--workers", nargs="+", default=["1", "4", "8"], help="worker counts, e.g. 1 4 8 or 1,4,8")
    p.add_argument(
        "--algorithms",
        nargs="+",
        default=list(ALGORITHMS),
        choices=list(ALGORITHMS),
        metavar="ALGO",
        help=f"a subset of {' '.join(ALGORITHMS)}",
    )
    p.add_argument("--seeds", type=int, default=None, help="number of seeds [5; --quick: 3]")
    p.add_argument("--epochs", type=float, default=None, help="effective epochs per run [40; --quick: 15]")
    p.add_argument("--batch-size", type=int, default=32, help="minibatch per worker")
    p.add_argument("--lr", type=float, default=0.5, help="initial learning rate (/10 at 50%% and 75%%)")
    p.add_argument("--lam-c", type=float, default=0.04, help="DC-ASGD-c lambda_0")
    p.add_argument("--lam-a", type=float, default=2.0, help="DC-ASGD-a lambda_0")
    p.add_argument("--momentum", type=float, default=None, help="momentum for every algorithm [none]")
    p.add_argument(
        "--compute-time",
        default="exponential",
        choices=["exponential", "constant", "lognormal"],
        help="the workers' compute-time distribution",
    )
    p.add_argument("--window", type=int, default=None, help="training-error smoothing window [400; --quick: 100]")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_ablate)


def _ints(flag: str, values: Sequence[str]) -> tuple[int, ...]:
    """``["1", "4", "8"]`` or ``["1,4,8"]`` as ``(1, 4, 8)``."""
    out = []
    for part in (p for v in values for p in str(v).split(",") if p.strip()):
        try:
            out.append(int(part))
        except ValueError:
            raise errors.ConfigError(f"{flag} {part!r} is invalid: give ints, e.g. {flag} 1 4 8.") from None
    return tuple(out)


def _ablate(args: argparse.Namespace) -> int:
    from asgd_jax import studies

    overrides = {
        "dataset": args.dataset,
        "data_dir": args.data_dir,
        "model": args.model,
        "workers": _ints("--workers", args.workers),
        "algorithms": tuple(args.algorithms),
        "seeds": tuple(range(args.seeds)) if args.seeds is not None else None,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "learning_rate": args.lr,
        "lam_c": args.lam_c,
        "lam_a": args.lam_a,
        "momentum": args.momentum,
        "compute_time": args.compute_time,
        "window": args.window,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if "workers" in overrides:  # checked here, so that the message names the flag
        errors.require(
            all(m >= 1 for m in overrides["workers"]) and len(set(overrides["workers"])) == len(overrides["workers"]),
            "workers",
            list(overrides["workers"]),
            "give distinct worker counts >= 1 (--workers 1 4 8)",
        )
    errors.output_folder("out", args.out, "--out")  # before the work, not after it
    print(
        f"asgd-jax ablate: {args.dataset}/{args.model}, M in {list(overrides['workers'])}, "
        f"{'quick' if args.quick else 'full'} form; loading data and compiling...",
        flush=True,
    )
    result = studies.ablate(quick=args.quick, progress=not args.no_progress, **overrides)
    paths = studies.save(result, args.out, plots=("panels",))
    seeds = len(result.settings.seeds)
    print(f"\n{studies.format_table(result.study, result.runs, seeds)}\n\n({result.seconds:.0f} s)")
    print("Wrote " + ", ".join(paths.values()))
    return 0


# --------------------------------------------------------------------------------------------------------------------
# asgd-jax data prepare
# --------------------------------------------------------------------------------------------------------------------


def _add_data(sub) -> None:
    p = sub.add_parser("data", help="prepare TFDS datasets", description="Dataset management.")
    data_sub = p.add_subparsers(title="commands", metavar="COMMAND")
    prep = data_sub.add_parser(
        "prepare",
        help="download and prepare a TFDS dataset once (array_record)",
        description=(
            "Runs TFDS's download_and_prepare with array_record output, so training reads it later without "
            "network access or TensorFlow. ImageNet needs --manual-dir with the archives downloaded by hand."
        ),
        formatter_class=Defaults,
    )
    prep.add_argument("name", help="cifar10, mnist, fashion_mnist, imagenet2012, or any TFDS name[:config]")
    prep.add_argument("--data-dir", default=None, help="where to write [$TFDS_DATA_DIR or ~/tensorflow_datasets]")
    prep.add_argument("--manual-dir", default=None, help="folder with manually downloaded archives (ImageNet)")
    prep.set_defaults(func=_prepare)
    p.set_defaults(func=lambda args: (p.print_help(), 0)[1])


def _prepare(args: argparse.Namespace) -> int:
    from asgd_jax import data

    path = data.prepare(args.name, data_dir=args.data_dir, manual_dir=args.manual_dir)
    print(f"Prepared {args.name} in {path}")
    return 0


# --------------------------------------------------------------------------------------------------------------------
# asgd-jax train
# --------------------------------------------------------------------------------------------------------------------

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


def _add_train(sub) -> None:
    from asgd_jax import rules, setups
    from asgd_jax.plan import MODES, PUSHES
    from asgd_jax.trainer.config import FAILURE_POLICIES, NONFINITE_POLICIES, TrainConfig

    d, ds = TrainConfig(), setups.Setup()
    dp = d.plan
    p = sub.add_parser(
        "train",
        help="asynchronous training on the devices JAX sees (GPUs, or fake CPU devices), or on Ray",
        description=(
            "Worker threads (worker w on device group w mod #groups) push to a host-side parameter store that "
            "applies the rule with the simulator's server step. Writes trace.jsonl (replayable with "
            "asgd_jax.delays.Trace.load), metrics.jsonl, checkpoint.npz, model.npz and summary.json into --out. "
            "Ctrl-C writes a final checkpoint; --resume continues. --config FILE (TOML or JSON, keys are the flag "
            "names) replaces flags; flags given on the command line win. --config NAME runs a setup that ships "
            f"with asgd_jax ({', '.join(shipped_configs())}): the paper's run."
        ),
        formatter_class=Defaults,
    )
    actions: list[argparse.Action] = []
    a = lambda *names, **kw: actions.append(p.add_argument(*names, **kw))
    a("--config", default=None, help="TOML or JSON file of flag values (e.g. workers = 4), or a shipped setup's name")
    a("--dataset", default="digits", help="mnist1d, digits or tfds:<name>")
    a("--data-dir", default=None, help="TFDS data directory")
    a("--model", default="mlp", help="mlp, cnn, resnet20, convnet, ...")
    a("--model-options", type=_table, default={}, help="model options as JSON, e.g. '{\"width\": 0.25}'")
    a("--dtype", default=ds.dtype, choices=setups.DTYPES, help="bfloat16: compute in bf16, float32 weights")
    a("--rule", default="dc_asgd_a", choices=rules.names(), help="the server's update rule")
    a("--lr", type=float, default=0.1, help="the server's (peak) learning rate")
    a("--schedule", default="constant", choices=setups.SCHEDULES, help="the learning rate's schedule")
    a("--decay-at", nargs="+", type=float, default=list(ds.decay_at), help="step decays, in --unit")
    a("--decay-factor", type=float, default=ds.decay_factor, help="step factor, or cosine's final fraction")
    a("--warmup", type=float, default=ds.warmup, help="linear warm-up, in --unit")
    a("--unit", default=ds.unit, choices=setups.UNITS, help="what --decay-at and --warmup count")
    a("--lam", type=float, default=None, help="DC-ASGD lambda_0 [the rule's: 0.04 for -c, 2 for -a]")
    a("--momentum", type=float, default=None, help="momentum of the rule [none]")
    a("--weight-decay", type=float, default=ds.weight_decay, help="L2 weight decay, chained before the rule")
    a("--augment", action=argparse.BooleanOptionalAction, default=ds.augment, help="random crop and flip")
    a("--eval-crop", type=int, default=None, help="evaluate on the central N x N crop")
    a("--eval-multi-crop", action=argparse.BooleanOptionalAction, default=False, help="average ten crops")
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
    a("--devices-per-worker", type=int, default=d.devices_per_worker, help="devices per worker (batch split)")
    a("--out", default="runs/train", help="the run's folder")
    a("--checkpoint-every", type=int, default=dp.checkpoint_every, help="updates between checkpoints [a tenth]")
    a(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        type=_resume_flag,
        help="continue from --out's checkpoint (which must be there); --resume auto: continue if there is one",
    )
    a("--warm-start-steps", type=int, default=d.warm_start_steps, help="first K updates with a single worker")
    a("--eval-every", type=int, default=dp.eval_every, help="updates between evaluations [a tenth]")
    a("--log-every", type=float, default=d.log_every, help="seconds between records of metrics.jsonl")
    a("--progress", action=argparse.BooleanOptionalAction, default=d.progress, help="a progress bar")
    a("--on-worker-failure", default=d.on_worker_failure, choices=FAILURE_POLICIES, help="a dead worker")
    a("--on-nonfinite", default=d.on_nonfinite, choices=NONFINITE_POLICIES, help="NaN/Inf pushes")
    a("--max-nonfinite", type=int, default=d.max_nonfinite, help="NaN/Inf pushes in a row that stop the run [10 x M]")
    a("--slowdown", nargs="+", default=None, metavar="W:F", help="straggler study: worker W F times slower")
    a("--timeout", type=float, default=d.timeout, help="seconds before the run is stopped")
    _add_where_flags(a, d)
    p.set_defaults(func=_train, parser=p, actions=actions)


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


def _resume_flag(value: str) -> bool | str:
    if value == "auto":
        return "auto"
    raise argparse.ArgumentTypeError(f"--resume takes no value or 'auto', not {value!r}")


def _parse_slowdown(values: Sequence[str] | None) -> dict[int, float]:
    out = {}
    for v in values or ():
        try:
            w, f = v.split(":")
            out[int(w)] = float(f)
        except ValueError:
            raise errors.ConfigError(f"--slowdown {v!r} is invalid: use WORKER:FACTOR, e.g. 0:4") from None
    return out


def _table(value: str) -> dict[str, Any]:
    """``--model-options``: a JSON object."""
    try:
        table = json.loads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): give e.g. '{{\"width\": 0.25}}'") from None
    if not isinstance(table, dict):
        raise argparse.ArgumentTypeError(f"{value!r} is not a JSON object: give e.g. '{{\"width\": 0.25}}'")
    return table


def shipped_configs() -> list[str]:
    """The setups that ship with asgd_jax (``asgd_jax/configs/*.toml``), by name."""
    import importlib.resources

    folder = importlib.resources.files("asgd_jax") / "configs"
    return sorted(f.name.removesuffix(".toml") for f in folder.iterdir() if f.name.endswith(".toml"))


def config_path(name_or_path: str) -> str:
    """A ``--config`` value as a file: a path, or the name of a setup that ships with asgd_jax."""
    import importlib.resources

    if os.path.exists(name_or_path) or os.sep in name_or_path or name_or_path.endswith((".toml", ".json")):
        return name_or_path
    if name_or_path in shipped_configs():
        return str(importlib.resources.files("asgd_jax") / "configs" / f"{name_or_path}.toml")
    raise errors.ConfigError(
        f"--config {name_or_path}: no such file, and no shipped setup of that name ({', '.join(shipped_configs())})."
    )


def load_config(path: str, actions: Sequence[argparse.Action]) -> dict[str, Any]:
    """Reads a TOML/JSON file of flag values (``n-sync``, ``n_sync``, or an alias such as ``steps``), checked against
    the flags ``actions`` define; returns them by destination. ``path`` may name a shipped setup."""
    import tomllib

    path = config_path(path)
    try:
        with open(path, "rb") as f:
            values = json.load(f) if path.endswith(".json") else tomllib.load(f)
    except FileNotFoundError:
        raise errors.ConfigError(f"--config {path}: no such file.") from None
    except OSError as e:  # a folder, a file that cannot be read
        raise errors.ConfigError(f"--config {path} cannot be read ({e.strerror}): give a TOML or JSON file.") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise errors.ConfigError(f"--config {path} does not parse: {e}") from None
    if not isinstance(values, dict):
        raise errors.ConfigError(f"--config {path} holds {type(values).__name__}: give a table of flag = value.")
    flags: dict[str, tuple[argparse.Action, bool]] = {}  # option name -> (its action, negated)
    for action in actions:
        for option in action.option_strings:
            name = option.lstrip("-").replace("-", "_")
            flags[name] = (action, name.startswith("no_") and isinstance(action, argparse.BooleanOptionalAction))
    flags = {k: v for k, v in flags.items() if v[0].dest != "config"}
    given = {k.replace("-", "_"): v for k, v in values.items()}
    unknown = sorted(set(given) - set(flags))
    if unknown:
        known = ", ".join(sorted(flags))
        raise errors.ConfigError(f"--config {path}: unknown option(s) {', '.join(unknown)}; use: {known}.")
    out = {}
    for k, v in given.items():
        action, negated = flags[k]
        v = _config_value(path, k, action, v)
        out[action.dest] = not v if negated else v
    return out


def _config_value(path: str, name: str, action: argparse.Action, value: Any) -> Any:
    """A config file's value for ``action``'s flag, type-checked as the command line would parse it."""
    is_number = lambda v: isinstance(v, int | float) and not isinstance(v, bool)
    if action.nargs in ("+", "*"):
        value = value if isinstance(value, list) else [value]
        if action.type is float:
            ok, expected = bool(value) and all(is_number(v) for v in value), "a list of numbers"
        else:
            ok, expected = all(isinstance(v, str) or is_number(v) for v in value), "a list of values"
            value = [str(v) for v in value]
    elif isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        ok, expected = isinstance(value, bool), "true or false"
    elif action.type is _resume_flag:
        ok, expected = value in (True, False, "auto"), "true, false or 'auto'"
    elif action.type is _table:
        ok, expected = isinstance(value, dict), "a table, e.g. { width = 0.25 }"
    elif action.type is int:
        ok, expected = errors.is_int(value), "an int"
    elif action.type is float:
        ok, expected = is_number(value), "a number"
    else:
        ok, expected = isinstance(value, str), "a string"
    if ok and action.choices is not None and not isinstance(value, list):
        ok, expected = value in action.choices, "one of " + ", ".join(map(repr, action.choices))
    if not ok:
        raise errors.ConfigError(f"--config {path}: {name} = {value!r} is invalid: give {expected}.")
    return value


# The Plan fields that are flags of `train` under their own names (its delays are --workers M; chunk is the
# simulator's alone).
PLAN_FLAGS = ("num_updates", "batch_size", "mode", "n_sync", "push", "local_lr", "eval_every", "checkpoint_every")


def _train_config(args: argparse.Namespace):
    from asgd_jax import delays
    from asgd_jax.plan import Plan
    from asgd_jax.trainer.config import TrainConfig

    methods = {"--ringmaster": args.ringmaster, "--rennala": args.rennala, "--msync": args.msync}
    given = [flag for flag, value in methods.items() if value is not None]
    errors.require(len(given) <= 1, "method", " and ".join(given), "choose one of --ringmaster, --rennala, --msync")
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
    plan = Plan(workers, **{name: getattr(args, name) for name in PLAN_FLAGS})
    skip = ("plan", "slowdown")
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig) if f.name not in skip}
    return TrainConfig(plan, **values, slowdown=_parse_slowdown(args.slowdown))


def _keep_the_driver_on_the_cpu() -> None:
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


def _add_args_to_summary(out: str, args: argparse.Namespace) -> dict[str, Any]:
    """Adds the command line's flags to the run's ``summary.json`` (if the run wrote one); returns the summary."""
    path = os.path.join(out, "summary.json")
    if not os.path.exists(path):  # stopped before the session began: there is no summary to add to
        return {}
    try:
        with open(path) as f:
            summary = json.load(f)
        summary["args"] = {k: v for k, v in vars(args).items() if k not in ("func", "parser", "actions", "top_parser")}
        with open(path, "w") as f:
            json.dump(summary, f, indent=2, default=str)
    except (OSError, ValueError) as e:
        print(f"asgd-jax: could not update {path}: {e}", file=sys.stderr)
        return {}
    return summary


def _train(args: argparse.Namespace) -> int:
    config = _train_config(args)  # every flag checked before anything loads
    setup = setup_of(args)
    train_rule(args, setup, config.plan)  # the rule's flags too (the schedule is made again once the data is known)
    if config.backend == "ray":
        _keep_the_driver_on_the_cpu()
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
        _add_args_to_summary(config.out, args)
        if os.path.exists(os.path.join(config.out, session.CHECKPOINT)):
            print(
                f"asgd-jax: {e or 'interrupted'} (checkpoint in {config.out}; add --resume to continue)",
                file=sys.stderr,
            )
        else:
            print("asgd-jax: interrupted before the first checkpoint: nothing to resume", file=sys.stderr)
        return 130
    except errors.RunStopped as e:
        _add_args_to_summary(config.out, args)
        saved = os.path.exists(os.path.join(config.out, session.CHECKPOINT))
        kept = "The last good checkpoint and" if saved else "No checkpoint had been written yet;"
        print(f"asgd-jax: {e}. {kept} summary.json {'are' if saved else 'is'} in {config.out}.", file=sys.stderr)
        return 1
    summary = _add_args_to_summary(config.out, args)
    error = f"{100 * result.evals[-1]['error']:.2f}%" if result.evals else "n/a"
    late = f", of which {result.pushes_late} arrived after the last update" if result.pushes_late else ""
    stopped = sum(w.stopped for w in result.workers)
    late += f", ignored {result.pushes_ignored} (too stale)" if result.pushes_ignored else ""
    late += f", computations stopped {stopped}" if stopped else ""
    print(
        f"test error {error} | pushes sent {result.pushes_sent}, applied {result.pushes_applied}, "
        f"rejected {result.pushes_rejected}{late} | {summary.get('updates_per_second', 0):.0f} updates/s | "
        f"trace: {result.trace_path}"
    )
    if result.ended == "timeout":
        print(
            f"asgd-jax: stopped by --timeout {config.timeout:g} s after {result.pushes_applied} of "
            f"{config.plan.num_updates} updates; --resume continues",
            file=sys.stderr,
        )
        return 3
    return 0 if not result.failures else 1


# --------------------------------------------------------------------------------------------------------------------
# asgd-jax run / report
# --------------------------------------------------------------------------------------------------------------------


def _add_run(sub) -> None:
    p = sub.add_parser(
        "run",
        help="run a reproduction study (dcasgd_table1, gpu_asgd_nsync, ... or a study file) in the simulator",
        description=(
            "Runs one study (a study of asgd_jax.experiments, see --list, or a .py file that defines STUDY) in the "
            "deterministic simulator and writes results.json, "
            "results.csv, table.md and plots into --out. --quick is minutes on 2 CPU cores on embedded data; "
            "without it the full form is the paper's setup (for a GPU)."
        ),
        formatter_class=Defaults,
    )
    p.add_argument("study", nargs="?", help="a study name (see --list) or a path to a study .py file")
    p.add_argument("--list", action="store_true", help="list the studies that ship with asgd_jax and exit")
    p.add_argument("--quick", action="store_true", help="the quick form")
    p.add_argument("--out", default=None, help="output folder [results/<study>]")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--seeds", type=int, default=None, help="run seeds 0..N-1 instead of the form's [the form's]")
    p.add_argument("--epochs", type=float, default=None, help="effective epochs per run [the form's]")
    p.add_argument("--tensorboard", action="store_true", help="also write every curve as TensorBoard event files")
    p.add_argument("--resume", action="store_true", help="finish a study killed midway: run only the missing arms")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace what --out holds: another study's (or other settings') results, or an unfinished run",
    )
    p.add_argument("--backend", default="local", choices=("local", "ray"), help="ray: each arm a task on a cluster")
    p.add_argument("--ray-address", default=None, help="the Ray cluster to join ('auto': the local `ray start`)")
    p.add_argument(
        "--widen",
        type=int,
        default=None,
        help="rounds of widening a tuned learning rate picked at the edge of its grid [the study's]",
    )
    p.add_argument(
        "--runs-per-task",
        type=int,
        default=None,
        help="with --backend ray: split an arm of more runs than this into tasks of whole seeds [one task per arm]",
    )
    p.set_defaults(func=_run_study)
    r = sub.add_parser(
        "report",
        help="turn a results folder into a Markdown report",
        description="Collects every results.json under DIR into DIR/report.md with the tables and plots embedded.",
        formatter_class=Defaults,
    )
    r.add_argument("dir", help="a results folder (one study, or a folder of study folders)")
    r.add_argument("--out", default=None, help="report path [DIR/report.md]")
    r.add_argument("--overwrite", action="store_true", help="replace a file at --out that is not a report")
    r.set_defaults(func=_report)


def _run_study(args: argparse.Namespace) -> int:
    from asgd_jax import studies

    if args.list or not args.study:
        for name in studies.available():
            print(f"{name:24s} {studies.load(name).title}")
        if args.list:
            return 0
        raise errors.ConfigError("asgd-jax run needs a study: one of the names above, or a path to a study .py file")
    study = studies.load(args.study)
    if args.widen is not None:
        study = dataclasses.replace(study, widen=args.widen)  # checked by the study, before the work
    out = errors.output_folder("out", args.out or f"results/{study.name}", "--out")  # before the work
    settings = study.quick if args.quick else study.full
    if args.seeds is not None:  # a shorter look at a long study: fewer seeds, fewer epochs
        settings = dataclasses.replace(
            settings, seeds=tuple(range(errors.positive_int("seeds", args.seeds, "--seeds")))
        )
    if args.epochs is not None:
        settings = dataclasses.replace(
            settings, epochs=errors.finite_number("epochs", args.epochs, positive=True, flag="--epochs")
        )
    print(f"asgd-jax run {study.name} ({'quick' if args.quick else 'full'} form): {study.title}", flush=True)
    what = "its own problem" if study.problem is not None else f"{settings.dataset}/{settings.model}"
    budget = (
        f"a virtual-time budget of {settings.time_budget:g}"
        if settings.time_budget is not None
        else f"{settings.epochs:g} epochs"
    )
    print(
        f"{what}, {len(settings.seeds)} seed(s), {budget}, {len(study.arms(settings, args.quick))} arms -> {out}",
        flush=True,
    )
    if args.tensorboard:
        from asgd_jax import writers

        writers.TensorBoard.check()  # the extra is there, before the study runs
    try:
        result = studies.run(
            study,
            quick=args.quick,
            progress=not args.no_progress,
            settings=settings,
            out=out,
            resume=args.resume,
            backend=args.backend,
            ray_address=args.ray_address,
            runs_per_task=args.runs_per_task,
            overwrite=args.overwrite,
        )
        paths = studies.save(result, out, tensorboard=args.tensorboard)
    except errors.RunStopped as e:  # a full disk: what is kept and how to finish, in one line
        print(f"asgd-jax: {e}.", file=sys.stderr)
        return 1
    print(f"\n{studies.format_table(study, result.runs, len(settings.seeds))}\n\n({result.seconds:.0f} s)")
    print("Wrote " + ", ".join(paths.values()))
    return 0


def _report(args: argparse.Namespace) -> int:
    import datetime
    import platform
    import subprocess

    import jax

    from asgd_jax import studies

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    header = (
        f"Generated {datetime.date.today()} at commit {commit} on {platform.machine()} "
        f"({jax.devices()[0].platform}, jax {jax.__version__})."
    )
    print(f"Wrote {studies.report(args.dir, args.out, header=header, overwrite=args.overwrite)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asgd-jax",
        description=(
            "Asynchronous SGD in JAX (DC-ASGD, GPU A-SGD and the staleness-mitigation rules since): a deterministic "
            "staleness simulator (ablate, run, report) and a multi-device trainer (train)."
        ),
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    _add_ablate(sub)
    _add_data(sub)
    _add_train(sub)
    _add_run(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``asgd-jax``; returns the exit status."""
    from asgd_jax import interrupts  # imports nothing of JAX: the handler is in place before JAX starts

    with interrupts.watch():  # a Ctrl-C at any moment stops the command, even one JAX's gc callback swallowed
        try:
            interrupts.check()
            return _main(argv)
        except KeyboardInterrupt:
            print("asgd-jax: interrupted", file=sys.stderr)
            return 130


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line's arguments, a ``--config`` file's values in place (flags on the command line still win)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None):  # file values become the defaults; flags on the command line still win
        args.parser.set_defaults(**load_config(args.config, args.actions))
        args = parser.parse_args(argv)
    args.top_parser = parser
    return args


def _main(argv: Sequence[str] | None) -> int:
    logging.basicConfig(level=logging.WARNING, format="asgd-jax: %(levelname)s: %(name)s: %(message)s")
    from asgd_jax import cache, interrupts

    try:
        args = parse(argv)
        if not hasattr(args, "func"):
            args.top_parser.print_help()
            return 0
        cache.enable()  # compiled programs kept across runs ($ASGD_JAX_CACHE_DIR moves it, =off disables it)
        interrupts.check()  # one that arrived while JAX started
        return args.func(args)
    except errors.ConfigError as e:  # a user's mistake: what and how to fix it, no traceback
        print(f"asgd-jax: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
