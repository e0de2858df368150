"""Counting the programs XLA compiles (what the compile-once tests and the argument checks pin)."""

import collections
import contextlib
import json

import jax

COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def compilations():
    """Counts the programs XLA compiles inside the block, by name (``simulator_chunk``, ...). A program loaded from the
    persistent cache counts too (JAX times ``compile_or_get_cached`` as one event): 0 means nothing compiled or
    loaded, every program was found in the process."""
    counts: collections.Counter = collections.Counter()

    def listen(event, duration, **kwargs):
        if event == COMPILE:
            counts[kwargs.get("fun_name", "?").removeprefix("jit(").removesuffix(")")] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


class Census:
    """XLA's compile seconds and program count per test, for ``experiments/benchmarks/compile_census.py``: on when
    ``$ASGD_JAX_COMPILE_CENSUS`` names a file prefix (each pytest process writes ``<prefix>.<worker>.json``), a
    no-op otherwise. A test's setup (its fixtures) counts as the test's."""

    def __init__(self, prefix: str | None):
        self.prefix, self.current = prefix, "<collection>"
        self.seconds: collections.Counter = collections.Counter()
        self.programs: collections.Counter = collections.Counter()
        self.by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])  # a program's name -> s, n
        if prefix:
            jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event, duration, **kwargs):
        if event == COMPILE:
            self.seconds[self.current] += duration
            self.programs[self.current] += 1
            named = self.by_name[kwargs.get("fun_name", "?").removeprefix("jit(").removesuffix(")")]
            named[0] += duration
            named[1] += 1

    def start(self, nodeid: str) -> None:
        self.current = nodeid

    def write(self, worker: str) -> None:
        if self.prefix:
            with open(f"{self.prefix}.{worker}.json", "w") as f:
                tests = {k: [self.seconds[k], self.programs[k]] for k in self.seconds}
                json.dump({"tests": tests, "programs": self.by_name}, f)

    def close(self) -> None:
        if self.prefix:
            jax.monitoring.unregister_event_duration_listener(self._listen)
