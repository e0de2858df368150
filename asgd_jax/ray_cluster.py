"""Joining a Ray cluster, for the trainer's Ray backend and the studies' Ray runs alike.

Example:
  >>> from asgd_jax import ray_cluster
  >>> ray_cluster.INSTALL
  "pip install 'asgd_jax[ray]'  (or: pip install ray)"
"""

from __future__ import annotations

import socket

from asgd_jax import errors

__all__ = ["INSTALL", "PROBE_SECONDS", "join", "require_ray", "unreachable"]

INSTALL = "pip install 'asgd_jax[ray]'  (or: pip install ray)"
PROBE_SECONDS = 5.0  # how long a cluster's address is given to accept a connection


def unreachable(address: str) -> str | None:
    """Why nothing answers at a ``host:port`` (or ``ray://host:port``) address, or ``None`` when something does or
    the address is not of that form (``"auto"``: Ray finds the local cluster itself)."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return None
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=PROBE_SECONDS).close()
    except OSError as e:
        return f"nothing accepts a connection at {host or '127.0.0.1'}:{port}: {e.strerror or type(e).__name__}"
    return None


def join(address: str | None) -> None:
    """Joins the Ray cluster at ``address`` (or starts a local instance), unless this process already has; a cluster
    that cannot be reached is a :class:`~asgd_jax.errors.ConfigError` naming it (--ray-address)."""
    ray = require_ray()
    if ray.is_initialized():
        return
    why = None if address is None else unreachable(address)
    if why is not None:  # Ray itself would retry for minutes before it gives up
        raise errors.ConfigError(
            f"ray_address={address!r} (--ray-address) cannot be reached ({why}): start the cluster there (ray start "
            "--head) or give its address; without --ray-address a local instance starts"
        )
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError) as e:
        raise errors.ConfigError(
            f"ray_address={address!r} (--ray-address) cannot be joined ({type(e).__name__}: {str(e).splitlines()[0]}):"
            " start the cluster (ray start --head) or give its address; without --ray-address a local instance starts"
        ) from None


def require_ray():
    """Imports Ray, or fails at once with the install command."""
    try:
        import ray
    except ImportError:
        raise errors.MissingDependency(
            f"backend='ray' (--backend ray) needs Ray, which is not installed: {INSTALL}"
        ) from None
    return ray
