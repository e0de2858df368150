"""The ``asgd-jax`` command line.

Subcommands:
  ablate         the staleness ablation (DC-ASGD Table 1 in miniature).
  data prepare   download and prepare a TFDS dataset once (the only command that downloads).
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asgd-jax",
        description="Asynchronous SGD in JAX: DC-ASGD and GPU A-SGD, simulated deterministically.",
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    _add_ablate(sub)
    _add_data(sub)
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
