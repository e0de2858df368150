"""``asgd-jax run`` (a reproduction study, one of asgd_jax.experiments or a study file, in the simulator) and
``asgd-jax report`` (a Markdown report of a results folder)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from asgd_jax import errors
from asgd_jax.cli.flags import Defaults

__all__ = ["add_run"]


def add_run(sub) -> None:
    from asgd_jax import studies

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
    p.add_argument("--backend", default="local", choices=studies.BACKENDS, help="ray: each arm a task on a cluster")
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
        tuning = dataclasses.replace(study.tuning, widen=args.widen)  # checked here, before the work
        study = dataclasses.replace(study, tuning=tuning)
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

    from asgd_jax import provenance, studies

    # (the commit of the checkout asgd_jax is imported from, not of the folder this runs in)
    header = f"Generated {datetime.date.today()} by {provenance.describe(provenance.environment())}."
    print(f"Wrote {studies.report(args.dir, args.out, header=header, overwrite=args.overwrite)}")
    return 0
