"""Reading a setup file: a TOML or JSON table of ``asgd-jax train``'s flag values (``n-sync``, ``n_sync``, or an alias
such as ``steps``), checked against the flags as the command line would parse them; a name instead of a path runs a
setup that ships with asgd_jax (``asgd_jax/configs/*.toml``, beside this module)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import Any

from asgd_jax import errors

__all__ = ["config_path", "load_config", "resume_flag", "shipped_configs", "table"]


def resume_flag(value: str) -> bool | str:
    if value == "auto":
        return "auto"
    raise argparse.ArgumentTypeError(f"--resume takes no value or 'auto', not {value!r}")


def table(value: str) -> dict[str, Any]:
    """``--model-options``: a JSON object."""

    def refuse(constant: str):
        raise ValueError(f"{constant} is not a JSON number")

    try:
        table = json.loads(value, parse_constant=refuse)  # (Python's json reads NaN and Infinity; JSON has neither)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): give e.g. '{{\"width\": 0.25}}'") from None
    if not isinstance(table, dict):
        raise argparse.ArgumentTypeError(f"{value!r} is not a JSON object: give e.g. '{{\"width\": 0.25}}'")
    return table


def shipped_configs() -> list[str]:
    """The setups that ship with asgd_jax (``asgd_jax/configs/*.toml``), by name."""
    import importlib.resources

    folder = importlib.resources.files("asgd_jax") / "configs"
    return sorted(f.name.removesuffix(".toml") for f in folder.iterdir() if f.name.endswith(".toml"))


def config_path(name_or_path: str) -> str:
    """A ``--config`` value as a file: a path, or the name of a setup that ships with asgd_jax."""
    import importlib.resources

    if os.path.exists(name_or_path) or os.sep in name_or_path or name_or_path.endswith((".toml", ".json")):
        return name_or_path
    if name_or_path in shipped_configs():
        return str(importlib.resources.files("asgd_jax") / "configs" / f"{name_or_path}.toml")
    raise errors.ConfigError(
        f"--config {name_or_path}: no such file, and no shipped setup of that name ({', '.join(shipped_configs())})."
    )


def load_config(path: str, actions: Sequence[argparse.Action]) -> dict[str, Any]:
    """Reads a TOML/JSON file of flag values (``n-sync``, ``n_sync``, or an alias such as ``steps``), checked against
    the flags ``actions`` define; returns them by destination. ``path`` may name a shipped setup."""
    import tomllib

    path = config_path(path)
    try:
        with open(path, "rb") as f:
            values = json.load(f) if path.endswith(".json") else tomllib.load(f)
    except FileNotFoundError:
        raise errors.ConfigError(f"--config {path}: no such file.") from None
    except OSError as e:  # a folder, a file that cannot be read
        raise errors.ConfigError(f"--config {path} cannot be read ({e.strerror}): give a TOML or JSON file.") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise errors.ConfigError(f"--config {path} does not parse: {e}") from None
    if not isinstance(values, dict):
        raise errors.ConfigError(f"--config {path} holds {type(values).__name__}: give a table of flag = value.")
    flags: dict[str, tuple[argparse.Action, bool]] = {}  # option name -> (its action, negated)
    for action in actions:
        for option in action.option_strings:
            name = option.lstrip("-").replace("-", "_")
            flags[name] = (action, name.startswith("no_") and isinstance(action, argparse.BooleanOptionalAction))
    flags = {k: v for k, v in flags.items() if v[0].dest != "config"}
    given = {k.replace("-", "_"): v for k, v in values.items()}
    unknown = sorted(set(given) - set(flags))
    if unknown:
        known = ", ".join(sorted(flags))
        raise errors.ConfigError(f"--config {path}: unknown option(s) {', '.join(unknown)}; use: {known}.")
    out = {}
    for k, v in given.items():
        action, negated = flags[k]
        v = _config_value(path, k, action, v)
        out[action.dest] = not v if negated else v
    return out


def _config_value(path: str, name: str, action: argparse.Action, value: Any) -> Any:
    """A config file's value for ``action``'s flag, type-checked as the command line would parse it."""
    is_number = lambda v: isinstance(v, int | float) and not isinstance(v, bool)
    if action.nargs in ("+", "*"):
        value = value if isinstance(value, list) else [value]
        if action.type is float:
            ok, expected = bool(value) and all(is_number(v) for v in value), "a list of numbers"
        else:
            ok, expected = all(isinstance(v, str) or is_number(v) for v in value), "a list of values"
            value = [str(v) for v in value]
    elif isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        ok, expected = isinstance(value, bool), "true or false"
    elif action.type is resume_flag:
        ok, expected = value in (True, False, "auto"), "true, false or 'auto'"
    elif action.type is table:
        ok, expected = isinstance(value, dict), "a table, e.g. { width = 0.25 }"
    elif action.type is int:
        ok, expected = errors.is_int(value), "an int"
    elif action.type is float:
        ok, expected = is_number(value), "a number"
    else:
        ok, expected = isinstance(value, str), "a string"
    if ok and action.choices is not None and not isinstance(value, list):
        ok, expected = value in action.choices, "one of " + ", ".join(map(repr, action.choices))
    if not ok:
        raise errors.ConfigError(f"--config {path}: {name} = {value!r} is invalid: give {expected}.")
    return value
