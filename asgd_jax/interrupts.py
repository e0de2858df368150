"""Ctrl-C stops a run at any moment, even when something swallowed the ``KeyboardInterrupt`` it raised.

Python raises ``KeyboardInterrupt`` wherever the main thread happens to be. While JAX compiles, that can be inside a
garbage-collection callback, which prints the exception and drops it: the run then trained to its end and exited 0.
:func:`watch` installs a SIGINT handler that also remembers the interrupt; the places a long run passes often (the
trainer's driver loop, the simulator between chunks, a backend before its clock starts) call :func:`check`, which
raises it again. An interrupt is never lost, and a run stops where it stops on a later Ctrl-C: with its final
checkpoint.

A process that was started with SIGINT ignored (a background job of a non-interactive shell, ``make test &``) keeps
ignoring it: :func:`watch` leaves such a handler alone.

Example:
  >>> from asgd_jax import interrupts
  >>> with interrupts.watch():
  ...     interrupts.check()  # nothing arrived: returns
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

__all__ = ["check", "watch"]

_arrived = threading.Event()


def _handler(signum, frame) -> None:
    _arrived.set()
    raise KeyboardInterrupt


@contextlib.contextmanager
def watch() -> Iterator[None]:
    """Remembers a Ctrl-C for :func:`check` while the block runs (in the main thread; elsewhere it does nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous in (signal.SIG_IGN, _handler):  # ignored on purpose, or an outer watch() already installed it
        yield
        return
    _arrived.clear()
    signal.signal(signal.SIGINT, _handler)
    hook = sys.unraisablehook
    sys.unraisablehook = lambda raised: None if _remembered(raised) else hook(raised)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = hook
        _arrived.clear()


def _remembered(raised) -> bool:
    """A KeyboardInterrupt that a callback swallowed while :func:`watch` remembers it: no traceback to print, the run
    stops at the next :func:`check`."""
    return isinstance(raised.exc_value, KeyboardInterrupt) and _arrived.is_set()


def check() -> None:
    """Raises ``KeyboardInterrupt`` if a Ctrl-C arrived under :func:`watch` (once: the next call returns)."""
    if _arrived.is_set():
        _arrived.clear()
        raise KeyboardInterrupt
