"""``asgd-jax ablate``: DC-ASGD's Table 1 in miniature (the ``dcasgd_table1`` study with flags), in the simulator."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from asgd_jax import errors
from asgd_jax.cli.flags import Defaults, dataset_help

__all__ = ["add_ablate"]


def add_ablate(sub) -> None:
    from asgd_jax import delays, models, studies
    from asgd_jax.experiments._dcasgd import ALGORITHMS

    s = studies.load("dcasgd_table1").form("ablate")  # what asgd_jax.studies.ablate runs, the flags' defaults

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
    p.add_argument("--dataset", default=s.dataset, help=dataset_help())
    p.add_argument(
        "--data-dir", default=s.data_dir, help="TFDS data directory [$TFDS_DATA_DIR or ~/tensorflow_datasets]"
    )
    p.add_argument("--model", default=s.model, choices=models.names(), help="the model, by name")
    p.add_argument("--workers", nargs="+", default=list(map(str, s.workers)), help="worker counts, e.g. 1 4 8 or 1,4,8")
    p.add_argument(
        "--algorithms",
        nargs="+",
        default=list(s.algorithms),
        choices=list(ALGORITHMS),
        metavar="ALGO",
        help=f"a subset of {' '.join(ALGORITHMS)}",
    )
    p.add_argument("--seeds", type=int, default=None, help="number of seeds [5; --quick: 3]")
    p.add_argument("--epochs", type=float, default=None, help="effective epochs per run [40; --quick: 15]")
    p.add_argument("--batch-size", type=int, default=s.batch_size, help="minibatch per worker")
    p.add_argument("--lr", type=float, default=s.learning_rate, help="initial learning rate (/10 at 50%% and 75%%)")
    p.add_argument("--lam-c", type=float, default=s.lam_c, help="DC-ASGD-c lambda_0")
    p.add_argument("--lam-a", type=float, default=s.lam_a, help="DC-ASGD-a lambda_0")
    p.add_argument("--momentum", type=float, default=s.momentum, help="momentum for every algorithm [none]")
    p.add_argument(
        "--compute-time",
        default=s.compute_time,
        choices=list(delays.COMPUTE_TIME_KINDS),
        help="the workers' compute-time distribution",
    )
    p.add_argument("--window", type=int, default=None, help="training-error smoothing window [400; --quick: 100]")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--resume", action="store_true", help="finish an ablation killed midway: run only the missing arms")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace what --out holds: another study's (or other settings') results, or an unfinished run",
    )
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
    try:  # each arm kept in --out as it finishes: a killed ablation resumes (--resume)
        result = studies.ablate(
            quick=args.quick,
            progress=not args.no_progress,
            out=args.out,
            resume=args.resume,
            overwrite=args.overwrite,
            **overrides,
        )
        paths = studies.save(result, args.out, plots=("panels",))
    except errors.RunStopped as e:  # a full disk: what is kept and how to finish, in one line
        print(f"asgd-jax: {e}.", file=sys.stderr)
        return 1
    seeds = len(result.settings.seeds)
    print(f"\n{studies.format_table(result.study, result.runs, seeds)}\n\n({result.seconds:.0f} s)")
    print("Wrote " + ", ".join(paths.values()))
    return 0
