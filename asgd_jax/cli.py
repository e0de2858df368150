"""The ``asgd-jax`` command line.

Subcommands:
  ablate         the staleness ablation (DC-ASGD Table 1 in miniature).
  data prepare   download and prepare a TFDS dataset once (the only command that downloads).
  train          real asynchronous training: worker threads on the devices JAX sees, a host-side parameter store.
  run            a reproduction study from experiments/ (quick or full form).
  report         a Markdown report of a results folder.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _add_ablate(sub: argparse._SubParsersAction) -> None:
    from asgd_jax.ablation import ALGORITHMS

    p = sub.add_parser(
        "ablate",
        help="staleness ablation: SGD/ASGD/SSGD/DC-ASGD-c/DC-ASGD-a x workers x seeds",
        description=(
            "Runs {SGD (M=1), ASGD, SSGD, DC-ASGD-c, DC-ASGD-a} x workers x seeds in the deterministic simulator, "
            "prints final test error (mean ± std over seeds) laid out like DC-ASGD's Table 1, and writes "
            "results.json, results.csv, table.md and curves.png into --out."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="about a minute on 2 CPU cores (3 seeds, 15 epochs)")
    p.add_argument("--out", default="results/ablation", help="output folder")
    p.add_argument("--dataset", default=None, help="mnist1d, digits or tfds:<name> (e.g. tfds:cifar10) [mnist1d]")
    p.add_argument("--data-dir", default=None, help="TFDS data directory [$TFDS_DATA_DIR or ~/tensorflow_datasets]")
    p.add_argument("--model", default=None, help="model: mlp or cnn [mlp]")
    p.add_argument("--workers", nargs="+", default=None, help="worker counts, e.g. 1 4 8 [1 4 8]")
    p.add_argument(
        "--algorithms", nargs="+", default=None, choices=list(ALGORITHMS), metavar="ALGO",
        help=f"subset of {' '.join(ALGORITHMS)} [all]",
    )  # fmt: skip
    p.add_argument("--seeds", type=int, default=None, help="number of seeds [5; --quick: 3]")
    p.add_argument("--epochs", type=float, default=None, help="effective epochs per run [40; --quick: 15]")
    p.add_argument("--batch-size", type=int, default=None, help="minibatch per worker [32]")
    p.add_argument("--lr", type=float, default=None, help="initial learning rate (/10 at 50%% and 75%%) [0.5]")
    p.add_argument("--lam-c", type=float, default=None, help="DC-ASGD-c lambda_0 [0.04]")
    p.add_argument("--lam-a", type=float, default=None, help="DC-ASGD-a lambda_0 [2.0]")
    p.add_argument("--momentum", type=float, default=None, help="momentum for every algorithm [none]")
    p.add_argument(
        "--compute-time", default=None, choices=["exponential", "constant", "lognormal"],
        help="worker compute-time distribution [exponential]",
    )  # fmt: skip
    p.add_argument("--window", type=int, default=None, help="training-error smoothing window [400; --quick: 100]")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_ablate)


def _ablate(args: argparse.Namespace) -> int:
    from asgd_jax import ablation

    overrides = {
        "dataset": args.dataset,
        "data_dir": args.data_dir,
        "model": args.model,
        "workers": ablation.parse_ints(args.workers),
        "algorithms": tuple(args.algorithms) if args.algorithms else None,
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
    config = ablation.AblationConfig.quick(**overrides) if args.quick else ablation.AblationConfig(**overrides)
    programs = config.groups()
    print(
        f"asgd-jax ablate: {config.dataset}/{config.model}, M in {list(config.workers)}, "
        f"{len(config.seeds)} seeds, {config.epochs:g} epochs -> {len(programs)} compiled programs",
        flush=True,
    )
    result = ablation.run(config, progress=not args.no_progress)
    paths = ablation.save(result, args.out)
    print(f"\nFinal test error (%), mean ± std over {len(config.seeds)} seeds ({result.seconds:.0f} s):\n")
    print(ablation.format_table(result))
    print("\nWrote " + ", ".join(paths.values()))
    return 0


def _add_data(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="prepare TFDS datasets", description="Dataset management.")
    data_sub = p.add_subparsers(title="commands", metavar="COMMAND")
    prep = data_sub.add_parser(
        "prepare",
        help="download and prepare a TFDS dataset once (array_record)",
        description=(
            "Runs TFDS's download_and_prepare with array_record output, so training reads it later without "
            "network access or TensorFlow. ImageNet needs --manual-dir with the archives downloaded by hand."
        ),
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


RULES = ("asgd", "dc_asgd", "dc_asgd_a", "staleness_aware", "delay_adaptive")


def make_rule(name: str, lr: float, lam: float | None, workers: int, momentum: float | None):
    """A rule by its CLI name (``dc_asgd`` is DC-ASGD-c; ``--lam`` defaults to the paper's 0.04 / 2)."""
    from asgd_jax import rules

    if name == "asgd":
        return rules.asgd(lr, momentum=momentum)
    if name == "dc_asgd":
        return rules.dc_asgd(lr, 0.04 if lam is None else lam, momentum=momentum)
    if name == "dc_asgd_a":
        return rules.dc_asgd(lr, 2.0 if lam is None else lam, adaptive=True, momentum=momentum)
    if name == "staleness_aware":
        return rules.staleness_aware_sgd(lr, momentum=momentum)
    if name == "delay_adaptive":
        return rules.delay_adaptive_sgd(lr, workers, momentum=momentum)
    raise ValueError(f"rule={name!r} is invalid: use one of {', '.join(RULES)}.")


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="asynchronous training on the devices JAX sees (GPUs, or fake CPU devices)",
        description=(
            "Worker threads (worker w on device group w mod #groups) push to a host-side parameter store that "
            "applies the rule with the simulator's server step. Writes trace.jsonl (replayable with "
            "asgd_jax.delays.Trace.load), metrics.jsonl, checkpoint.npz, model.npz and summary.json into --out. "
            "Ctrl-C writes a final checkpoint; --resume continues. --config FILE (TOML or JSON, keys are the flag "
            "names) replaces flags; flags given on the command line win."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--config", default=None, help="TOML or JSON file of flag values, e.g. workers = 4")
    p.add_argument("--dataset", default="digits", help="mnist1d, digits or tfds:<name>")
    p.add_argument("--data-dir", default=None, help="TFDS data directory")
    p.add_argument("--model", default="mlp", help="mlp, cnn, resnet20, convnet, ...")
    p.add_argument("--rule", default="dc_asgd_a", choices=RULES)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--mode", default="async", choices=["async", "sync"], help="sync: SSGD baseline, same devices")
    p.add_argument("--devices-per-worker", type=int, default=1, help="devices per worker (batch split over them)")
    p.add_argument("--steps", type=int, default=2000, help="server updates (applied pushes), warm-up included")
    p.add_argument("--batch-size", type=int, default=32, help="minibatch per worker")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--lam", type=float, default=None, help="DC-ASGD lambda_0 [0.04 for -c, 2 for -a]")
    p.add_argument("--momentum", type=float, default=None)
    p.add_argument("--n-sync", type=int, default=1, help="minibatches between exchanges (GPU A-SGD)")
    p.add_argument("--push", default="gradients", choices=["gradients", "delta", "accumulate"])
    p.add_argument("--local-lr", type=float, default=None, help="local step size when --n-sync > 1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warm-start", default=None, metavar="CHECKPOINT", help="start from a saved model.npz / run dir")
    p.add_argument("--warm-start-steps", type=int, default=0, help="first K updates with a single worker")
    p.add_argument("--checkpoint-every", type=int, default=None, help="updates between checkpoints [steps/10]")
    p.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
    p.add_argument("--eval-every", type=int, default=None, help="updates between evaluations [steps/10]")
    p.add_argument("--on-worker-failure", default="continue", choices=["continue", "stop"])
    p.add_argument("--on-nonfinite", default="reject", choices=["reject", "stop"], help="NaN/Inf pushes")
    p.add_argument("--slowdown", nargs="+", default=None, metavar="W:F", help="straggler study: worker W F x slower")
    p.add_argument("--timeout", type=float, default=24 * 3600.0, help="seconds before the run is stopped")
    p.add_argument("--backend", default="threads", choices=["threads", "ray"], help="ray: actors on a Ray cluster")
    p.add_argument("--ray-address", default=None, help="Ray cluster to join ('auto': the local `ray start`)")
    p.add_argument(
        "--max-restarts", type=int, default=0, help="Ray: restarts of a dead worker actor before dropping it"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--out", default="runs/train")
    p.set_defaults(func=_train, parser=p)


def _parse_slowdown(values: Sequence[str] | None) -> dict[int, float]:
    out = {}
    for v in values or ():
        try:
            w, f = v.split(":")
            out[int(w)] = float(f)
        except ValueError:
            raise ValueError(f"--slowdown {v!r} is invalid: use WORKER:FACTOR, e.g. 0:4") from None
    return out


def load_config(path: str, parser: argparse.ArgumentParser) -> dict:
    """Reads a TOML/JSON file of flag values (``n-sync`` or ``n_sync``), checked against ``parser``'s flags."""
    import json
    import tomllib

    try:
        with open(path, "rb") as f:
            values = json.load(f) if path.endswith(".json") else tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"--config {path}: no such file.") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--config {path} does not parse: {e}") from None
    known = {a.dest for a in parser._actions} - {"help", "config", "func", "parser"}
    values = {k.replace("-", "_"): v for k, v in values.items()}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"--config {path}: unknown option(s) {', '.join(unknown)}; use: {', '.join(sorted(known))}.")
    return values


def _keep_the_driver_on_the_cpu() -> None:
    """Ray: the driver (data, initial weights, evaluation) stays on the CPU. The worker actors own the GPUs, and a
    driver on GPU 0 would take most of its memory (JAX preallocates) from the worker placed there. Only possible before
    JAX starts its backends (it has not, in the CLI); a JAX without this private probe just keeps its default."""
    import jax

    try:
        from jax._src import xla_bridge

        started = xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):
        return
    if not started:
        jax.config.update("jax_platforms", "cpu")


def _train(args: argparse.Namespace) -> int:
    import json
    import os

    import jax

    from asgd_jax import checkpoint, data, models, trainer

    if args.backend == "ray":
        _keep_the_driver_on_the_cpu()
    slowdown = _parse_slowdown(args.slowdown)
    ds = data.load(args.dataset, data_dir=args.data_dir)
    model = models.get(args.model, num_classes=ds.num_classes, input_shape=ds.input_shape)
    rule = make_rule(args.rule, args.lr, args.lam, args.workers, args.momentum)
    params, model_state = model.init(jax.random.key(args.seed))
    if args.warm_start:
        params, model_state = checkpoint.load_model(args.warm_start, params, model_state)
    devices = jax.devices()
    every = max(1, args.steps // 10)
    where = (f"worker actors on Ray ({args.ray_address or 'a local instance'})" if args.backend == "ray" else
             f"workers on {len(devices)} {devices[0].platform} device(s)")  # fmt: skip
    print(f"asgd-jax train: {args.workers} {args.mode} {where} ({args.devices_per_worker} device(s) per worker), "
          f"{args.rule}, {args.steps} updates -> {args.out}", flush=True)  # fmt: skip
    try:
        result = trainer.train(
            models.classification_loss(model), rule, params, ds.train, num_workers=args.workers, steps=args.steps,
            batch_size=args.batch_size, key=jax.random.key(args.seed), model_state=model_state, mode=args.mode,
            n_sync=args.n_sync, push=args.push, local_learning_rate=args.local_lr, devices=devices,
            devices_per_worker=args.devices_per_worker, out_dir=args.out,
            checkpoint_every=args.checkpoint_every or every, resume=args.resume,
            warm_start_steps=args.warm_start_steps, eval_fn=models.classification_eval(model, ds.test),
            eval_every=args.eval_every or every, progress=not args.no_progress,
            on_worker_failure=args.on_worker_failure, on_nonfinite=args.on_nonfinite,
            slowdown=slowdown, timeout=args.timeout, backend=args.backend, ray_address=args.ray_address,
            max_restarts=args.max_restarts,
        )  # fmt: skip
    except KeyboardInterrupt as e:
        print(f"asgd-jax: {e} (checkpoint in {args.out}; add --resume to continue)", file=sys.stderr)
        return 130
    error = result.evals[-1]["error"]
    summary = {
        "test_error": error,
        "evals": result.evals,
        "pushes_sent": result.pushes_sent,
        "pushes_applied": result.pushes_applied,
        "pushes_rejected": result.pushes_rejected,
        "pushes_late": result.pushes_late,
        "failures": result.failures,
        "resumed_from": result.resumed_from,
        "seconds": result.seconds,
        "updates_per_second": (result.pushes_applied - result.resumed_from) / max(result.seconds, 1e-9),
        "worker_overhead": [w.overhead for w in result.workers],
        "staleness_counts": result.staleness_counts,
        "args": {k: v for k, v in vars(args).items() if k not in ("func", "parser")},
    }
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    print(f"test error {100 * error:.2f}% | pushes sent {result.pushes_sent}, applied {result.pushes_applied}, "
          f"rejected {result.pushes_rejected} ({result.pushes_late} in flight at the end) | "
          f"{summary['updates_per_second']:.0f} updates/s | "
          f"trace: {result.trace_path}")  # fmt: skip
    return 0 if not result.failures else 1


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="run a reproduction study from experiments/ (dcasgd_table1, gpu_asgd_nsync, ...)",
        description=(
            "Runs one study (experiments/<study>.py) in the deterministic simulator and writes results.json, "
            "results.csv, table.md and plots into --out. --quick is minutes on 2 CPU cores on embedded data; "
            "without it the full form is the paper's setup (for a GPU)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("study", nargs="?", help="a study name (see --list) or a path to a study .py file")
    p.add_argument("--list", action="store_true", help="list the studies in experiments/ and exit")
    p.add_argument("--quick", action="store_true", help="the quick form")
    p.add_argument("--out", default=None, help="output folder [results/<study>]")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_run_study)
    r = sub.add_parser(
        "report",
        help="turn a results folder into a Markdown report",
        description="Collects every results.json under DIR into DIR/report.md with the tables and plots embedded.",
    )
    r.add_argument("dir", help="a results folder (one study, or a folder of study folders)")
    r.add_argument("--out", default=None, help="report path [DIR/report.md]")
    r.set_defaults(func=_report)


def _run_study(args: argparse.Namespace) -> int:
    from asgd_jax import studies

    if args.list or not args.study:
        for name in studies.available():
            print(f"{name:24s} {studies.load(name).title}")
        return 0 if args.list else 2
    study = studies.load(args.study)
    out = args.out or f"results/{study.name}"
    settings = study.quick if args.quick else study.full
    print(f"asgd-jax run {study.name} ({'quick' if args.quick else 'full'} form): {study.title}", flush=True)
    print(f"{settings.dataset}/{settings.model}, {len(settings.seeds)} seed(s), {settings.epochs:g} epochs, "
          f"{len(study.arms(settings, args.quick))} compiled programs -> {out}", flush=True)  # fmt: skip
    result = studies.run(study, quick=args.quick, progress=not args.no_progress)
    paths = studies.save(result, out)
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
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    header = (f"Generated {datetime.date.today()} at commit {commit} on {platform.machine()} "
              f"({jax.devices()[0].platform}, jax {jax.__version__}).")  # fmt: skip
    print(f"Wrote {studies.report(args.dir, args.out, header=header)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asgd-jax",
        description="Asynchronous SGD in JAX: DC-ASGD and GPU A-SGD, simulated deterministically.",
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    _add_ablate(sub)
    _add_data(sub)
    _add_train(sub)
    _add_run(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``asgd-jax``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 0
    logging.basicConfig(level=logging.WARNING, format="asgd-jax: %(levelname)s: %(name)s: %(message)s")
    try:
        if getattr(args, "config", None):  # file values become the defaults; flags on the command line still win
            args.parser.set_defaults(**load_config(args.config, args.parser))
            args = parser.parse_args(argv)
        return args.func(args)
    except (ValueError, ImportError) as e:  # a user's mistake: say what and how to fix it, no traceback
        print(f"asgd-jax: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("asgd-jax: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
