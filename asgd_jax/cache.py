"""Compiled programs kept across processes: JAX's persistent compilation cache, on for the command line and studies.

Within a process the simulator compiles each program once per structure (see :mod:`asgd_jax.simulator`). Across
processes, JAX can keep the compiled executables on disk; :func:`enable` turns that on in a user cache folder (never
inside the repository), so a second ``make demo``, ``asgd-jax run <study>`` or ``make test`` loads its programs instead
of compiling them. ``asgd-jax`` and :func:`asgd_jax.studies.run` call it; in a notebook, call it yourself before the
first computation (it also works later: JAX's cache is reset to the new folder).

Where: ``$ASGD_JAX_CACHE_DIR`` if set (``off`` disables the cache), else a ``JAX_COMPILATION_CACHE_DIR`` you set for
JAX yourself, else ``$XDG_CACHE_HOME/asgd_jax/xla`` (``~/.cache/asgd_jax/xla``). Delete the folder to clear it; JAX
keys each entry on the program, the JAX version and the device, so a stale entry is never used.

JAX writes an entry in place and never replaces one, so a write cut short (a kill, a full disk) would be read, and
fail, on every later run: in a process that imports asgd_jax's engines (or calls :func:`enable`) the writes are atomic,
and a program that failed to load writes its entry anew (:func:`atomic_entries`).

Within a process, a :class:`Kept` holds the programs a wing builds, keyed on what shapes them (the trainer's store
and worker programs: a second run at other numbers compiles nothing; the simulator keeps its own).

Generated datasets (MNIST-1D takes ~3 s to generate on two cores, more than a quick study's arithmetic) are kept in
:func:`data_folder`: ``$ASGD_JAX_CACHE_DIR/datasets`` if that is set (``off``: nothing kept), else
``$XDG_CACHE_HOME/asgd_jax/datasets``. Each file carries a checksum of its arrays and is regenerated when it does not
match (a truncated or corrupted file is never used).

Example:
  >>> import asgd_jax
  >>> asgd_jax.cache.folder({"ASGD_JAX_CACHE_DIR": "off"}) is None
  True
  >>> asgd_jax.cache.folder({"XDG_CACHE_HOME": "/tmp/c"})
  '/tmp/c/asgd_jax/xla'
  >>> asgd_jax.cache.data_folder({"XDG_CACHE_HOME": "/tmp/c"})
  '/tmp/c/asgd_jax/datasets'
"""

from __future__ import annotations

import collections
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Hashable, Mapping
from typing import Any

__all__ = [
    "ENV",
    "TMP_SUFFIX",
    "Kept",
    "atomic_entries",
    "clear",
    "compile_with",
    "data_folder",
    "enable",
    "folder",
    "hashable",
    "platform_of",
]

ENV = "ASGD_JAX_CACHE_DIR"
OFF = ("off", "0", "false", "no", "")


def folder(environ: Mapping[str, str] | None = None) -> str | None:
    """Where the cache lives under ``environ`` (default: this process's environment), or ``None`` when it is off."""
    environ = os.environ if environ is None else environ
    if ENV in environ:
        value = environ[ENV].strip()
        return None if value.lower() in OFF else os.path.abspath(os.path.expanduser(value))
    if environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.path.abspath(os.path.expanduser(environ["JAX_COMPILATION_CACHE_DIR"]))
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "asgd_jax", "xla")


def data_folder(environ: Mapping[str, str] | None = None) -> str | None:
    """Where generated datasets are kept under ``environ`` (default: this process's environment), or ``None`` when
    ``ASGD_JAX_CACHE_DIR`` turns caching off."""
    environ = os.environ if environ is None else environ
    if ENV in environ:
        value = environ[ENV].strip()
        return None if value.lower() in OFF else os.path.join(os.path.abspath(os.path.expanduser(value)), "datasets")
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "asgd_jax", "datasets")


def enable(path: str | os.PathLike | None = None) -> str | None:
    """Turns on JAX's persistent compilation cache in ``path`` (default: :func:`folder`) for every program, however
    quickly it compiles (the simulator's small programs add up). Returns the folder, or ``None`` when the cache is
    off (``ASGD_JAX_CACHE_DIR=off``) or the folder cannot be made."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    if path is not None:
        where = os.path.abspath(os.fspath(path))
    elif os.environ.get(ENV) is None and jax.config.jax_compilation_cache_dir:
        where = jax.config.jax_compilation_cache_dir  # one the program set for JAX itself
    else:
        where = folder()
    if where is None:
        return None
    try:
        os.makedirs(where, exist_ok=True)
    except OSError:
        return None
    if jax.config.jax_compilation_cache_dir != where:
        jax.config.update("jax_compilation_cache_dir", where)
        compilation_cache.reset_cache()  # a cache JAX already set up (or decided against) starts again here
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    atomic_entries(where)
    return where


TMP_SUFFIX = ".asgd_jax.tmp"  # an entry being written (a leftover one: the writer was killed)


def atomic_entries(where: str | None = None) -> bool:
    """Makes JAX's persistent cache write each entry whole or not at all, and replace an entry it writes again.

    JAX (0.10) writes an entry in place and never replaces one: a process killed, or a disk filled, in the middle of a
    write leaves a truncated entry that every later run fails to read (a warning, and the program compiled again, for
    good). Here an entry is written to a temporary file beside it and renamed into place; a write that fails leaves
    nothing, and a program whose entry could not be read is written anew once compiled, which mends the cache.
    Leftover temporary files in ``where`` older than an hour are removed. A JAX without the cache class this patches
    (or a size-capped cache, whose access times JAX keeps itself) is left as it is: returns whether writes are atomic.
    """
    try:  # JAX's private cache class, guarded: no public way to make its writes atomic
        from jax._src import lru_cache  # noqa: PLC2701

        cls, suffix = lru_cache.LRUCache, lru_cache._CACHE_SUFFIX  # noqa: SLF001
    except (ImportError, AttributeError):
        return False
    if where is not None:
        _sweep_leftovers(where)
    if getattr(cls.put, "atomic", False):
        return True
    jax_put = cls.put

    def put(self, key: str, value: bytes) -> None:
        local = os.path.isdir(str(self.path)) and "://" not in str(self.path)
        if getattr(self, "eviction_enabled", True) or not key or not local:
            return jax_put(self, key, value)
        from asgd_jax import checkpoint  # (a process that writes JAX's cache has JAX, and so this, loaded)

        # Whole, or not there (a racing writer's equal entry is simply replaced); no fsync: an entry lost to a power
        # cut is compiled again.
        path = os.path.join(str(self.path), f"{key}{suffix}")
        checkpoint.atomic_write(path, lambda f: f.write(value), suffix=TMP_SUFFIX, fsync=False)

    put.atomic = True  # type: ignore[attr-defined]
    cls.put = put
    return True


def _sweep_leftovers(where: str, age: float = 3600.0) -> None:
    """Removes temporary entries in ``where`` that a killed writer left (older than ``age`` seconds)."""
    import time

    try:
        names = [n for n in os.listdir(where) if n.endswith(TMP_SUFFIX)]
    except OSError:
        return
    for name in names:
        path = os.path.join(where, name)
        try:
            if time.time() - os.path.getmtime(path) > age:
                os.remove(path)
        except OSError:
            pass


def platform_of(tree: Any) -> str:
    """The platform a program for ``tree``'s arrays runs on: that of the first placed array's devices, else JAX's
    default backend (what decides a program's per-platform options and form)."""
    import jax

    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        if sharding is not None:
            return next(iter(sharding.device_set)).platform
    return jax.default_backend()


def hashable(obj: Any) -> bool:
    """Whether ``obj`` can key a cache (a value: a program kept for it serves every equal one)."""
    try:
        hash(obj)
    except TypeError:
        return False
    return True


_UNKNOWN_OPTIONS: set[tuple] = set()  # option sets this jaxlib refused: compiled with XLA's defaults from then on


def compile_with(lowered: Any, options: Mapping[str, Any] | None) -> Any:
    """``lowered.compile(options)`` (XLA options for one program: a model's initialisation, a run's start, compiled
    lighter on a CPU), with XLA's defaults where this jaxlib does not know one of them: a lighter compilation is
    worth having, never worth a failure. Said once per option set (a ``UserWarning``), not tried again."""
    import jax

    key = tuple(sorted((options or {}).items()))
    if not key or key in _UNKNOWN_OPTIONS:
        return lowered.compile()
    try:
        return lowered.compile(dict(key))
    except jax.errors.JaxRuntimeError as e:
        if "no such compile option" not in str(e).lower():
            raise
        _UNKNOWN_OPTIONS.add(key)
        warnings.warn(
            f"this jaxlib does not know an XLA option of {dict(key)} ({e}); asgd_jax compiles those programs with "
            "XLA's defaults instead (the same results, a slower compilation).",
            stacklevel=2,
        )
        return lowered.compile()


def clear() -> None:
    """Forgets everything every :class:`Kept` holds (the trainer's programs: its next run of each structure compiles
    again; the simulator's are :func:`asgd_jax.simulator.clear_cache`'s) and the XLA options :func:`compile_with`
    found this jaxlib does not know."""
    for kept in list(_EVERY):
        kept.clear()
    _UNKNOWN_OPTIONS.clear()


class Kept:
    """Up to ``size`` things (compiled programs, the functions that hold them) kept in this process, keyed on what
    shapes them, the least recently used dropped first; thread-safe. A key that cannot be hashed (a list, dict or
    array among its parts) is built every time and not kept.

    Example:
      >>> kept = Kept(2)
      >>> kept.get(("sgd", 3), lambda: object()) is kept.get(("sgd", 3), lambda: object())
      True
      >>> kept.get({"unhashable"}, lambda: 1), len(kept)
      (1, 1)
    """

    def __init__(self, size: int):
        self.size = size
        self._kept: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        _EVERY.add(self)

    def get(self, key: Any, build: Callable[[], Any]) -> Any:
        """What is kept for ``key``, or ``build()`` kept for it (built outside the lock: a build may compile)."""
        if not hashable(key):
            return build()
        with self._lock:
            if key in self._kept:
                self._kept.move_to_end(key)
                return self._kept[key]
        made = build()
        with self._lock:
            made = self._kept.setdefault(key, made)  # (another thread's build of the same key, if it came first)
            self._kept.move_to_end(key)
            while len(self._kept) > self.size:
                self._kept.popitem(last=False)
        return made

    def clear(self) -> None:
        """Forgets everything kept."""
        with self._lock:
            self._kept.clear()

    def __len__(self) -> int:
        return len(self._kept)


_EVERY: weakref.WeakSet[Kept] = weakref.WeakSet()
