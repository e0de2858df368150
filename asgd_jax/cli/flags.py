"""What the sub-commands' parsers share: the help formatter that shows every flag's default, and what ``--dataset``
takes (the library's datasets by name)."""

from __future__ import annotations

import argparse

__all__ = ["Defaults", "dataset_help"]

Defaults = argparse.ArgumentDefaultsHelpFormatter


def dataset_help() -> str:
    """``--dataset``'s help: the embedded datasets (:data:`asgd_jax.data.EMBEDDED`), or a prepared TFDS one."""
    from asgd_jax import data

    return f"{', '.join(data.EMBEDDED)} or tfds:<name> (e.g. tfds:{data.TFDS_DOCUMENTED[0]})"
