"""The ``asgd-jax`` command line.

Subcommands:
  ablate         the staleness ablation (DC-ASGD Table 1 in miniature).
  data prepare   download and prepare a TFDS dataset once (the only command that downloads).
  train          real asynchronous training: worker threads on the devices JAX sees, a host-side parameter store.
"""

from __future__ import annotations

import argparse
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
            "One worker thread per device (worker w on device w mod #devices) pushes to a host-side parameter store "
            "that applies the rule with the simulator's server step. Writes trace.jsonl (replayable with "
            "asgd_jax.delays.Trace.load) and summary.json into --out."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--dataset", default="digits", help="mnist1d, digits or tfds:<name>")
    p.add_argument("--data-dir", default=None, help="TFDS data directory")
    p.add_argument("--model", default="mlp", help="mlp, cnn, resnet20, convnet, ...")
    p.add_argument("--rule", default="dc_asgd_a", choices=RULES)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=2000, help="server updates (applied pushes)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--lam", type=float, default=None, help="DC-ASGD lambda_0 [0.04 for -c, 2 for -a]")
    p.add_argument("--momentum", type=float, default=None)
    p.add_argument("--n-sync", type=int, default=1, help="minibatches between exchanges (GPU A-SGD)")
    p.add_argument("--push", default="gradients", choices=["gradients", "delta", "accumulate"])
    p.add_argument("--local-lr", type=float, default=None, help="local step size when --n-sync > 1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--on-worker-failure", default="continue", choices=["continue", "stop"])
    p.add_argument("--out", default="runs/train")
    p.set_defaults(func=_train)


def _train(args: argparse.Namespace) -> int:
    import json
    import os

    import jax

    from asgd_jax import data, models, trainer

    ds = data.load(args.dataset, data_dir=args.data_dir)
    model = models.get(args.model, num_classes=ds.num_classes, input_shape=ds.input_shape)
    rule = make_rule(args.rule, args.lr, args.lam, args.workers, args.momentum)
    params, model_state = model.init(jax.random.key(args.seed))
    devices = jax.devices()
    print(f"asgd-jax train: {args.workers} workers on {len(devices)} {devices[0].platform} device(s), {args.rule}, "
          f"{args.steps} updates", flush=True)  # fmt: skip
    result = trainer.train(
        models.classification_loss(model), rule, params, ds.train, num_workers=args.workers, steps=args.steps,
        batch_size=args.batch_size, key=jax.random.key(args.seed), model_state=model_state, n_sync=args.n_sync,
        push=args.push, local_learning_rate=args.local_lr, out_dir=args.out,
        on_worker_failure=args.on_worker_failure,
    )  # fmt: skip
    error = float(models.classification_eval(model, ds.test)(result.params, result.model_state)["error"])
    summary = {
        "test_error": error,
        "pushes_sent": result.pushes_sent,
        "pushes_applied": result.pushes_applied,
        "pushes_rejected": result.pushes_rejected,
        "failures": result.failures,
        "seconds": result.seconds,
        "updates_per_second": result.pushes_applied / max(result.seconds, 1e-9),
        "args": vars(args) | {"func": None},
    }
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    print(f"test error {100 * error:.2f}% | pushes sent {result.pushes_sent}, applied {result.pushes_applied}, "
          f"rejected {result.pushes_rejected} | {summary['updates_per_second']:.0f} updates/s | "
          f"trace: {result.trace_path}")  # fmt: skip
    return 0 if not result.failures else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asgd-jax",
        description="Asynchronous SGD in JAX: DC-ASGD and GPU A-SGD, simulated deterministically.",
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    _add_ablate(sub)
    _add_data(sub)
    _add_train(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``asgd-jax``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except (ValueError, ImportError) as e:  # a user's mistake: say what and how to fix it, no traceback
        print(f"asgd-jax: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("asgd-jax: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
