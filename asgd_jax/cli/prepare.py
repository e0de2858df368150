"""``asgd-jax data prepare``: download and prepare a TFDS dataset once (the only command that downloads)."""

from __future__ import annotations

import argparse

from asgd_jax.cli.flags import Defaults

__all__ = ["add_data"]


def add_data(sub) -> None:
    from asgd_jax import data

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
    prep.add_argument("name", help=f"{', '.join(data.TFDS_DOCUMENTED)}, or any TFDS name[:config]")
    prep.add_argument("--data-dir", default=None, help="where to write [$TFDS_DATA_DIR or ~/tensorflow_datasets]")
    prep.add_argument("--manual-dir", default=None, help="folder with manually downloaded archives (ImageNet)")
    prep.set_defaults(func=_prepare)
    p.set_defaults(func=lambda args: (p.print_help(), 0)[1])


def _prepare(args: argparse.Namespace) -> int:
    from asgd_jax import data

    path = data.prepare(args.name, data_dir=args.data_dir, manual_dir=args.manual_dir)
    print(f"Prepared {args.name} in {path}")
    return 0
