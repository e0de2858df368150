"""Joining a Ray cluster, for the trainer's Ray backend and the studies' Ray runs alike.

Example:
  >>> from asgd_jax import ray_cluster
  >>> ray_cluster.INSTALL
  "pip install 'asgd_jax[ray]'  (or: pip install ray)"
"""

from __future__ import annotations

from asgd_jax import errors

__all__ = ["INSTALL", "join", "require_ray"]

INSTALL = "pip install 'asgd_jax[ray]'  (or: pip install ray)"


def join(address: str | None) -> None:
    """Joins the Ray cluster at ``address`` (or starts a local instance), unless this process already has; a cluster
    that cannot be reached is a :class:`~asgd_jax.errors.ConfigError` naming it (--ray-address)."""
    ray = require_ray()
    if ray.is_initialized():
        return
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
