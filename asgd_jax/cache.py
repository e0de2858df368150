"""Compiled programs kept across processes: JAX's persistent compilation cache, on for the command line and studies.

Within a process the simulator compiles each program once per structure (see :mod:`asgd_jax.simulator`). Across
processes, JAX can keep the compiled executables on disk; :func:`enable` turns that on in a user cache folder (never
inside the repository), so a second ``make demo``, ``asgd-jax run <study>`` or ``make test`` loads its programs instead
of compiling them. ``asgd-jax`` and :func:`asgd_jax.studies.run` call it; in a notebook, call it yourself before the
first computation (it also works later: JAX's cache is reset to the new folder).

Where: ``$ASGD_JAX_CACHE_DIR`` if set (``off`` disables the cache), else a ``JAX_COMPILATION_CACHE_DIR`` you set for
JAX yourself, else ``$XDG_CACHE_HOME/asgd_jax/xla`` (``~/.cache/asgd_jax/xla``). Delete the folder to clear it; JAX
keys each entry on the program, the JAX version and the device, so a stale entry is never used.

Generated datasets (MNIST-1D takes ~3 s to generate on two cores, more than a quick study's arithmetic) are kept in
:func:`data_folder`: ``$ASGD_JAX_CACHE_DIR/datasets`` if that is set (``off``: nothing kept), else
``$XDG_CACHE_HOME/asgd_jax/datasets``. Each file carries a checksum of its arrays and is regenerated when it does not
match (a truncated or corrupted file is never used).

How much XLA:CPU optimises a program depends on what it does and how often it runs (:data:`CPU_COMPILER_OPTIONS`): a
model's initialisation compiles 2-3x faster than with XLA's defaults, to the same initial weights.

Example:
  >>> import asgd_jax
  >>> asgd_jax.cache.compiler_options("init", "gpu") is None
  True
  >>> asgd_jax.cache.folder({"ASGD_JAX_CACHE_DIR": "off"}) is None
  True
  >>> asgd_jax.cache.folder({"XDG_CACHE_HOME": "/tmp/c"})
  '/tmp/c/asgd_jax/xla'
  >>> asgd_jax.cache.data_folder({"XDG_CACHE_HOME": "/tmp/c"})
  '/tmp/c/asgd_jax/datasets'
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["CPU_COMPILER_OPTIONS", "ENV", "compiler_options", "data_folder", "enable", "folder"]

ENV = "ASGD_JAX_CACHE_DIR"
OFF = ("off", "0", "false", "no", "")

CPU_COMPILER_OPTIONS: Mapping[str, Mapping[str, object]] = {
    "init": {"xla_backend_optimization_level": 1, "xla_cpu_use_fusion_emitters": False},
}
"""XLA:CPU's options by what a program does, where another choice than XLA's defaults compiles faster and leaves every
result the same bits (``tests/test_compile.py`` pins it; ``experiments/benchmarks/same_bits.py``):

* ``"init"``, a built-in model's initialisation (random draws, once per model): LLVM's lighter pipeline and XLA's
  older fusion emitters, 2-3x faster to compile (the cnn 0.5 s instead of 1.4 s, ResNet-20 1.7 s instead of 3.6 s,
  ResNet-50 5.2 s instead of 6.9 s), the same initial weights for every model of :func:`asgd_jax.models.get`.

Measured and left at XLA's defaults: the simulator's start compiles in half the time with level 1 or the older
emitters, but both change the workers' first compute times in the last bit for some laws (level 1 or 2 a sum of
``n_sync`` draws, the older emitters a logarithm); the update loop and the evaluation at level 1 change a
convolution's results; the older emitters compile the update loop in ~60% of the time and run it ~30% slower; without
LLVM's most expensive passes it compiles 1.5% faster in ``make demo``'s ablation (10% on W alone)."""


def compiler_options(kind: str, platform: str) -> dict[str, object] | None:
    """The XLA options for a program of ``kind`` (``"init"``, see
    :data:`CPU_COMPILER_OPTIONS`) on ``platform`` (``"cpu"``, ``"gpu"``, ...); ``None`` (XLA's defaults) off a CPU."""
    options = CPU_COMPILER_OPTIONS[kind] if platform == "cpu" else None
    return dict(options) if options else None


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
    return where
