"""Errors a user can cause, and the one set of checks that raise them.

Every check names the argument (or flag) it rejects, the value it got and what is allowed, and raises
:class:`ConfigError`, a ``ValueError``: Python callers catch ``ValueError`` as before, and the command line reports a
``ConfigError`` in one line (exit status 2) while any other exception, a bug, keeps its traceback.

Example:
  >>> from asgd_jax import errors
  >>> errors.positive_int("n_sync", 4)
  4
  >>> errors.positive_int("n_sync", 0)
  Traceback (most recent call last):
  ...
  asgd_jax.errors.ConfigError: n_sync=0 is invalid: use an int >= 1.
"""

from __future__ import annotations

import errno
import math
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = [
    "ConfigError",
    "MissingDependency",
    "RunStopped",
    "choice",
    "differing",
    "finite_number",
    "int_at_least",
    "is_int",
    "is_number",
    "is_numeric",
    "output_folder",
    "positive_int",
    "require",
    "write_failure",
]


class ConfigError(ValueError):
    """A setting a user gave is invalid; the message names it, the value and what is allowed."""


class RunStopped(RuntimeError):
    """A training run or a study stopped before its end for a reason it states (diverged, a full disk, a dead worker
    under ``on_worker_failure='stop'``); what could be saved (the last good checkpoint, ``summary.json``, a study's
    finished arms) is on disk, and the message says where."""


class MissingDependency(ConfigError, ImportError):
    """An optional package the asked-for feature needs is not installed; the message gives the install command."""


def require(ok: bool, name: str, value: Any, allowed: str, flag: str | None = None) -> None:
    """Raises ``ConfigError("<name>=<value> (<flag>) is invalid: <allowed>.")`` unless ``ok``; ``flag`` names the
    command-line flag that sets ``name``, when there is one."""
    if not ok:
        where = f" ({flag})" if flag else ""
        raise ConfigError(f"{name}={value!r}{where} is invalid: {allowed}.")


def is_int(value: Any) -> bool:
    """Whether ``value`` is an int (a Python or NumPy integer, not a bool)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def int_at_least(name: str, value: Any, lowest: int, flag: str | None = None) -> int:
    """``value`` as an int, if it is an int >= ``lowest``."""
    require(is_int(value) and value >= lowest, name, value, f"use an int >= {lowest}", flag)
    return int(value)


def positive_int(name: str, value: Any, flag: str | None = None) -> int:
    """``value`` as an int, if it is an int >= 1."""
    return int_at_least(name, value, 1, flag)


def differing(a: Any, b: Any, context: int = 24) -> tuple[str, str]:
    """Two values as a refusal names them: their reprs whole when short, else the part where they differ with
    ``context`` characters around it (a rule's recipe runs to hundreds of characters; what changed is a number)."""
    ra, rb = repr(a), repr(b)
    if max(len(ra), len(rb)) <= 2 * context + 32:
        return ra, rb
    same = lambda x, y: next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
    head = same(ra, rb)
    tail = same(ra[head:][::-1], rb[head:][::-1])
    lo = max(0, head - context)

    def window(r: str) -> str:
        hi = min(len(r), len(r) - tail + context, lo + 4 * context + 32)  # (a long change: its start)
        return ("…" if lo else "") + r[lo:hi] + ("…" if hi < len(r) else "")

    return window(ra), window(rb)


def is_numeric(dtype: Any) -> bool:
    """Whether ``dtype`` is a real number's: an integer or a float, NumPy's or one JAX adds (bfloat16, float8, ...);
    not a bool, a complex number or a time. (``np.issubdtype(jnp.bfloat16, np.number)`` is False: NumPy does not
    know ml_dtypes' floats.)"""
    import jax.numpy as jnp

    d = np.dtype(dtype)  # (a bool is neither; NumPy counts a timedelta64 as an integer)
    return d.kind != "m" and bool(jnp.issubdtype(d, jnp.integer) or jnp.issubdtype(d, jnp.floating))


def is_number(value: Any) -> bool:
    """Whether ``value`` is one real number given in Python: an int or a float, or a NumPy or ml_dtypes scalar of
    :func:`is_numeric`'s dtypes (a ``bfloat16`` one is no ``np.number``); not a bool."""
    if isinstance(value, bool | np.bool_):
        return False
    return isinstance(value, int | float) or (isinstance(value, np.generic) and is_numeric(value.dtype))


def finite_number(
    name: str, value: Any, *, lowest: float | None = None, positive: bool = False, flag: str | None = None
) -> float:
    """``value`` as a float, if it is a finite real number (>= ``lowest``, or > 0 with ``positive``)."""
    ok = is_number(value) and math.isfinite(float(value))
    if positive:
        require(ok and float(value) > 0, name, value, "use a finite number > 0", flag)
    elif lowest is not None:
        require(ok and float(value) >= lowest, name, value, f"use a finite number >= {lowest:g}", flag)
    else:
        require(ok, name, value, "use a finite number", flag)
    return float(value)


def choice(name: str, value: Any, choices: Iterable[str], flag: str | None = None) -> str:
    """``value``, if it is one of ``choices``."""
    choices = list(choices)
    require(value in choices, name, value, f"use one of {', '.join(map(repr, choices))}", flag)
    return value


def output_folder(name: str, path: Any, flag: str | None = None) -> str:
    """``path`` as a folder that exists and can be written (made if missing), checked before any work that would write
    into it: a file there, an unwritable place or a path that is not a string is a :class:`ConfigError`."""
    require(isinstance(path, str | os.PathLike) and os.fspath(path) != "", name, path, "give a folder path", flag)
    path = os.fspath(path)
    where = f" ({flag})" if flag else ""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{name}={path!r}{where} is a file: give a folder.")
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".asgd_jax_probe_{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"{name}={path!r}{where} cannot be written ({e.strerror}): choose another folder.") from None
    return path


def write_failure(error: OSError) -> str:
    """What a failed write means to a user: ``"the disk is full"`` (no space or quota left) or ``"a write failed
    (<reason>)"``.

    Example:
      >>> import errno
      >>> from asgd_jax import errors
      >>> errors.write_failure(OSError(errno.ENOSPC, "No space left on device"))
      'the disk is full (No space left on device)'
    """
    reason = error.strerror or str(error) or type(error).__name__
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk is full ({reason})"
    return f"a write failed ({reason})"
