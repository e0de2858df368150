"""A call's arguments checked: everything a user can get wrong, before anything is made on a device or compiled.

The plan, the rule, the keys, the run options (``on_nonfinite``, one of :data:`NONFINITE`; the checkpoint folder; the
progress bar), a sweep's devices and its hyperparameters. A bad argument is an :class:`asgd_jax.ConfigError` that names
it and says what to give.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from asgd_jax import errors
from asgd_jax.plan import Plan

NONFINITE = ("warn", "stop", "ignore")


def check_plan(plan: Any) -> Plan:
    if plan is None:
        return Plan()
    errors.require(isinstance(plan, Plan), "plan", plan, "give an asgd_jax.Plan(...) (delays, num_updates, ...)")
    return plan


def check_rule(rule: Any) -> None:
    ok = callable(getattr(rule, "init", None)) and callable(getattr(rule, "update", None))
    hint = "build one with asgd_jax.rules.get(name, learning_rate) or a rule function such as asgd_jax.dc_asgd(0.1)"
    errors.require(ok, "rule", rule, f"give an update rule (an optax transform): {hint}")


def check_key(name: str, key: Any, batched: bool) -> jax.Array:
    if isinstance(key, jax.Array | np.ndarray) and key.dtype == np.uint32 and key.shape[-1:] == (2,):
        key = jax.random.wrap_key_data(key)  # a legacy jax.random.PRNGKey: the same key, typed
    good = isinstance(key, jax.Array) and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    shape = "a 1-D array of keys, one per run (see asgd_jax.grid)" if batched else "one key, e.g. jax.random.key(0)"
    # An array is named by its kind and shape: its repr is every key's data, lines of it.
    named = f"<keys of shape {tuple(key.shape)}>" if good else key
    if isinstance(key, jax.Array | np.ndarray) and not good:
        named = f"<{key.dtype} array of shape {tuple(key.shape)}>"
    errors.require(good and key.ndim == (1 if batched else 0), name, named, f"give {shape}")
    if batched:
        errors.require(key.shape[0] >= 1, name, named, "give at least one key")
    return key


def _check_on_nonfinite(policy: Any) -> str:
    return errors.choice("on_nonfinite", policy, NONFINITE)


def check_options(on_nonfinite: Any, checkpoint_dir: Any, progress: Any) -> dict[str, Any]:
    """A call's run options, checked (before anything is made on a device) and in the forms its ``_Call`` holds."""
    return {
        "on_nonfinite": _check_on_nonfinite(on_nonfinite),
        "checkpoint_dir": _check_checkpoint_dir(checkpoint_dir),
        "progress": _check_progress(progress),
    }


def _check_progress(progress: Any) -> bool:
    errors.require(isinstance(progress, bool | np.bool_), "progress", progress, "use True or False")
    return bool(progress)


def _check_checkpoint_dir(checkpoint_dir: Any) -> str | None:
    if checkpoint_dir is None:
        return None
    errors.require(
        isinstance(checkpoint_dir, str | os.PathLike), "checkpoint_dir", checkpoint_dir, "give a folder path (or None)"
    )
    path = os.fspath(checkpoint_dir)
    errors.require(
        not os.path.exists(path) or os.path.isdir(path),
        "checkpoint_dir",
        path,
        "it is a file, not a folder: give a folder (it is made if missing)",
    )
    return path


def check_devices(devices: Any) -> list[jax.Device]:
    """The devices a sweep's runs are split over: given, or every local accelerator (one device on a CPU, whose fake
    devices share the same cores)."""
    if devices is None:
        local = jax.local_devices()
        return local if local[0].platform != "cpu" else local[:1]
    listed = list(devices) if isinstance(devices, Sequence) and not isinstance(devices, str) else []
    errors.require(
        bool(listed) and all(isinstance(d, jax.Device) for d in listed) and len(set(listed)) == len(listed),
        "devices",
        devices,
        "give a list of distinct jax devices, e.g. jax.devices()",
    )
    return listed


def check_hparams(hparams: Any, num_runs: int, per_run_arrays: bool = False) -> dict[str, jax.Array]:
    """One finite number per run for every hyperparameter ([R]); with a ``delays_fn`` a run's value may be an array
    ([R, ...], e.g. per-worker speeds)."""
    if hparams is None:
        return {}
    errors.require(isinstance(hparams, Mapping), "hparams", hparams, "give a dict of [R] arrays (see asgd_jax.grid)")
    out = {}
    for name, value in hparams.items():
        try:
            array = np.asarray(value)
        except (TypeError, ValueError):
            array = np.asarray(None)
        shaped = array.shape[:1] == (num_runs,) and (per_run_arrays or array.ndim == 1)
        ok = shaped and errors.is_numeric(array.dtype)
        errors.require(
            ok and bool(np.all(np.isfinite(array))),
            f"hparams[{name!r}]",
            value,
            f"give one finite number per run: an array with a leading axis of {num_runs}",
        )
        out[name] = value if isinstance(value, jax.Array) else array  # host arrays stay on the host until a call
    return out
