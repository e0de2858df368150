"""The ``asgd-jax`` command line.

Subcommands:
  ablate         DC-ASGD's Table 1 in miniature (the ``dcasgd_table1`` study with flags), in the simulator.
  data prepare   download and prepare a TFDS dataset once (the only command that downloads).
  train          real asynchronous training: workers on the devices JAX sees (or on Ray), a host-side parameter store.
  run            a reproduction study (one of asgd_jax.experiments, or a study file), in the simulator.
  report         a Markdown report of a results folder.

The package's modules, one per sub-command: :mod:`~asgd_jax.cli.ablate`, :mod:`~asgd_jax.cli.prepare` (``data
prepare``), :mod:`~asgd_jax.cli.train` (its flags, the setup, rule, plan and training configuration they build) and
:mod:`~asgd_jax.cli.run` (``run`` and ``report``), and :mod:`~asgd_jax.cli.flags`, what their parsers share. A
``--config`` file is read by :mod:`asgd_jax.configs`, beside the setups that ship.

A mistake in the input (:class:`asgd_jax.errors.ConfigError`) is reported in one line with exit status 2; anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import sys
from collections.abc import Sequence

from asgd_jax import errors
from asgd_jax.cli.ablate import add_ablate as _add_ablate
from asgd_jax.cli.flags import Defaults
from asgd_jax.cli.prepare import add_data as _add_data
from asgd_jax.cli.run import add_run as _add_run
from asgd_jax.cli.train import MODEL_FLAGS, PLAN_FLAGS, SETUP_FLAGS, setup_of, train_config, train_rule
from asgd_jax.cli.train import add_train as _add_train
from asgd_jax.cli.train import keep_the_driver_on_the_cpu as _keep_the_driver_on_the_cpu  # noqa: F401 (its name before)
from asgd_jax.configs import config_path, load_config, shipped_configs

__all__ = [
    "MODEL_FLAGS",
    "PLAN_FLAGS",
    "SETUP_FLAGS",
    "Defaults",
    "build_parser",
    "config_path",
    "load_config",
    "main",
    "parse",
    "setup_of",
    "shipped_configs",
    "train_config",
    "train_rule",
]


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
    """The command line's arguments, a ``--config`` file's values in place (flags on the command line still win);
    ``train --resume``: the run's own flags under both (:func:`asgd_jax.cli.train.flags_of_run`)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    configured: dict = {}
    if getattr(args, "config", None):  # file values become the defaults; flags on the command line still win
        configured = load_config(args.config, args.actions)
        args.parser.set_defaults(**configured)
        args = parser.parse_args(argv)
    of_run = getattr(args, "flags_of_run", None)
    found = of_run(args.out) if of_run is not None and args.resume and args.out else None
    if found is not None:  # the run's flags, then the file's, then the command line's
        flags, args_path = found
        args = _parse_with_record(parser, argv, args, flags, args_path, configured)
    args.top_parser = parser
    return args


def _parse_with_record(parser, argv, args, flags: dict, path: str, configured: dict) -> argparse.Namespace:
    """The command line parsed again over a run's recorded flags (``path``) and a config file's values; a recorded
    value the flag refuses is one error naming the file (argparse checks a default's type, not its choices)."""
    actions = {a.dest: a for a in args.actions}
    unknown = sorted(set(flags) - set(actions))
    if unknown:
        print(f"asgd-jax: --resume: {path} names flags this asgd_jax lacks, ignored: {unknown}", file=sys.stderr)
    flags = {k: v for k, v in flags.items() if k not in unknown}
    for name, value in flags.items():
        choices = actions[name].choices
        if choices is not None and value is not None and not isinstance(value, list) and value not in choices:
            flag = actions[name].option_strings[0]
            raise errors.ConfigError(
                f"--resume: {path} records {flag} {value!r}, not one of {', '.join(map(str, choices))}."
            )
    args.parser.set_defaults(**{**flags, **configured})
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            args = parser.parse_args(argv)
    except SystemExit:
        why = said.getvalue().strip().splitlines()[-1:] or ["refused"]
        raise errors.ConfigError(f"--resume: {path} records a flag value that is refused: {why[0]}") from None
    args.flags_from = path
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
