"""Counting the programs XLA compiles (what the compile-once tests and the argument checks pin)."""

import collections
import contextlib

import jax

COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def compilations():
    """Counts the programs XLA compiles inside the block, by name (``simulator_chunk``, ...)."""
    counts: collections.Counter = collections.Counter()

    def listen(event, duration, **kwargs):
        if event == COMPILE:
            counts[kwargs.get("fun_name", "?").removeprefix("jit(").removesuffix(")")] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
