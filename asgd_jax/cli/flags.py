"""What the sub-commands' parsers share: the help formatter that shows every flag's default."""

from __future__ import annotations

import argparse

__all__ = ["Defaults"]

Defaults = argparse.ArgumentDefaultsHelpFormatter
