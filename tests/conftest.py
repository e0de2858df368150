"""Strict JAX for the whole suite: 8 fake CPU devices, no silent rank promotion.

This runs before any test module imports JAX's backends, so the device count takes effect.
"""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests must never reach the network for data.
os.environ.setdefault("TFDS_DATA_DIR", os.path.join(os.path.dirname(__file__), "_no_tfds_data"))
os.environ.setdefault("MPLBACKEND", "Agg")
# The persistent compilation cache, as `asgd-jax` uses it (asgd_jax.cache: a user cache folder, never the repository;
# ASGD_JAX_CACHE_DIR moves or disables it). Exported to the environment, so the notebooks' kernels, Ray's workers and
# the subprocesses share it. It only skips recompiling the same HLO, so results are the same bits.
from asgd_jax import cache

if cache.folder() is not None:
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", cache.folder())
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_num_cpu_devices", 8)


import shutil  # noqa: E402
import socket  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402
from helpers.compiles import Census  # noqa: E402

CENSUS = Census(os.environ.get("ASGD_JAX_COMPILE_CENSUS"))  # (experiments/benchmarks/compile_census.py)


def pytest_runtest_setup(item):
    CENSUS.start(item.nodeid)


def pytest_sessionfinish(session):
    CENSUS.write(os.environ.get("PYTEST_XDIST_WORKER", "main"))


@pytest.fixture
def scratch_tempdir(monkeypatch, tmp_path):
    """``tempfile``'s folders (``mkdtemp()`` in a docstring example, TFDS's for a dataset not prepared on disk, which
    it never removes) go to this test's pytest folder, which pytest cleans, not to /tmp. Not for every test: Ray takes
    its session folder from ``tempfile``, and a pytest path is too long for its sockets."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


@pytest.fixture(scope="module")
def ray_temp_dir():
    """A root folder of its own for a module's Ray instances (their sessions: logs, sockets, spilled objects; a local
    cluster's address file), removed after the module: Ray keeps every session under /tmp/ray otherwise, three more a
    suite. Given as ``RAY_TMPDIR``, which Ray reads wherever it picks a folder (``ray.cluster_utils.Cluster`` writes
    its address to the default one even when given another, and fails where /tmp/ray does not exist). Short and in
    /tmp, as Ray's own default: its sockets' paths must fit in 107 characters (a pytest folder's do not)."""
    path = tempfile.mkdtemp(prefix="ray-", dir="/tmp" if os.path.isdir("/tmp") else None)
    os.makedirs(os.path.join(path, "ray"))
    before = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = path
    yield path
    if before is None:
        os.environ.pop("RAY_TMPDIR", None)
    else:
        os.environ["RAY_TMPDIR"] = before
    shutil.rmtree(path, ignore_errors=True)  # (a killed actor's process may still be writing its last log line)


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a network connection fails, the way it does on a machine without network."""

    def refuse(*args, **kwargs):
        raise OSError("network is unreachable (blocked by the test)")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def pytest_configure(config):
    """The units of work in the order :func:`pytest_collection_modifyitems` gives them: xdist would otherwise order
    them by their number of tests, and the Ray group (21 tests, the longest unit) started two thirds into the run."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)  # (before xdist's own, which names each test's group from these marks)
def pytest_collection_modifyitems(config, items):
    """Under ``--dist loadgroup`` a module is one unit of work: its tests share a worker, so a program, a jitted
    function or a module fixture is built once rather than in each worker. The longest unit, the Ray group (a process
    per actor), goes first so that it never ends the run alone (:func:`pytest_configure`)."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
    groups = lambda item: {m.args[0] if m.args else m.kwargs.get("name") for m in item.iter_markers("xdist_group")}
    items.sort(key=lambda item: "ray" not in groups(item))
