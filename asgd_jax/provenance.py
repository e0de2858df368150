"""What produced a result: asgd_jax's version and the commit of its checkout, JAX's, the machine and its devices.

A study's ``results.json`` and a training run's ``summary.json`` keep :func:`environment` under ``"environment"``, and
``asgd-jax report`` says for each study what produced it. The commit is that of the checkout asgd_jax is imported from
(an editable install, a clone on ``PYTHONPATH``), never of the folder a command runs in; ``None`` for a wheel.

Example:
  >>> from asgd_jax import provenance
  >>> sorted(provenance.environment())
  ['asgd_jax', 'commit', 'devices', 'jax', 'jaxlib', 'machine', 'python']
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from typing import Any

__all__ = ["commit", "describe", "environment"]

_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the folder that holds asgd_jax/


@functools.cache
def commit() -> str | None:
    """The short commit of the git checkout asgd_jax is imported from, ``+dirty`` when its tracked files differ from
    it; ``None`` when asgd_jax is not imported from a checkout (a wheel) or git cannot tell."""
    if not os.path.exists(os.path.join(_CHECKOUT, ".git")):
        return None
    # (--no-optional-locks: never the index's lock, which a user's own git command may be taking; no inherited GIT_*
    # variables, which a hook sets to point git at another repository)
    git = ["git", "--no-optional-locks", "-C", _CHECKOUT]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    run = lambda *args: subprocess.run([*git, *args], capture_output=True, text=True, timeout=10, env=env)
    try:
        head = run("rev-parse", "--short", "HEAD")
        changed = run("status", "--porcelain", "--", "asgd_jax")  # (a new module not yet added counts too)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0 or not head.stdout.strip():
        return None
    return head.stdout.strip() + ("+dirty" if changed.returncode == 0 and changed.stdout.strip() else "")


def environment() -> dict[str, Any]:
    """asgd_jax's version and :func:`commit`, JAX's and jaxlib's versions, Python's, the machine and the devices JAX
    sees in this process (``"8 cpu"``; a Ray run's driver keeps to the CPU, its workers' devices are their actors'):
    JSON values."""
    import jax
    import jaxlib

    from asgd_jax import __version__

    devices = jax.devices()
    return {
        "asgd_jax": __version__,
        "commit": commit(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "devices": f"{len(devices)} {devices[0].platform}",
    }


def describe(env: dict[str, Any] | None) -> str:
    """One line of an :func:`environment` (as a results file holds it), e.g. ``asgd_jax 0.1.0 (commit 1a2b3c4), jax
    0.10.2, 8 cpu devices, x86_64``; ``"an asgd_jax that did not record it"`` for results written before it was."""
    if not env:
        return "an asgd_jax that did not record it"
    made = f"asgd_jax {env.get('asgd_jax', '?')}" + (f" (commit {env['commit']})" if env.get("commit") else "")
    return f"{made}, jax {env.get('jax', '?')}, {env.get('devices', '?')} device(s), {env.get('machine', '?')}"
