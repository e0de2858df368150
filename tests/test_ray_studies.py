"""A study's arms as Ray tasks: the same numbers as a local run, on a local instance and on a two-node cluster that
loses a node midway; a resume on Ray runs only the missing arms; an arm that fails for its own reason is named."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from asgd_jax import studies

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.xdist_group("ray")  # one Ray instance at a time on a 2-core machine

STUDY_FILE = """
import dataclasses
from asgd_jax import studies
from asgd_jax.studies import Arm, Variant
from asgd_jax.plan import Plan

BASE = studies.load("dcasgd_table1")
TINY = studies.Settings(dataset="digits", seeds=(0,), epochs=0.3, evals=2, window=10, workers=(1, 2))


def broken_arms(s, quick):
    arms = BASE.arms(s, quick)
    bad = Arm({"M": 2, "mode": "broken"}, Plan(2), variants=(Variant("bad", rule="dc_asgd", hp={"lam": float("nan")}),))
    return arms[:1] + [bad]


STUDY = dataclasses.replace(BASE, name="tiny_table1", quick=TINY)
BROKEN = dataclasses.replace(BASE, name="broken_table1", quick=TINY, arms=broken_arms)
"""


@pytest.fixture(scope="module")
def study_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("studies") / "tiny_table1.py"
    path.write_text(STUDY_FILE)
    return path


@pytest.fixture(scope="module")
def local_result(study_file):
    return studies.run(studies.load(str(study_file)), quick=True, progress=False)


def _same(a, b) -> None:
    assert json.dumps(a.runs) == json.dumps(b.runs) and json.dumps(a.curves) == json.dumps(b.curves)


@pytest.fixture(scope="module")
def local_ray(ray_temp_dir):
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_a_study_on_ray_gives_the_local_numbers_and_resumes_only_what_is_missing(
    study_file, local_result, local_ray, tmp_path, caplog
):
    study = studies.load(str(study_file))
    on_ray = studies.run(study, quick=True, progress=False, backend="ray")
    _same(on_ray, local_result)
    # A resume on Ray: the first arm is on disk, only the others become tasks.
    out = tmp_path / "out"

    def stop(arm, runs, curves):
        raise KeyboardInterrupt  # killed after its first arm

    with pytest.raises(KeyboardInterrupt):
        studies.run(study, quick=True, progress=False, out=out, on_arm=stop)
    with caplog.at_level(logging.INFO, logger="asgd_jax.studies"):
        resumed = studies.run(study, quick=True, progress=False, out=out, resume=True, backend="ray")
    _same(resumed, local_result)
    assert f"resuming tiny_table1: 1 of {len(study.arms(study.quick, True))} arms done" in caplog.text
    assert sorted(p.name for p in (out / "arms").iterdir()) == sorted(
        ["study.json"] + [f"{i}.json" for i in range(len(study.arms(study.quick, True)))]
    )


def test_an_arm_split_into_tasks_of_seeds_gives_the_arms_numbers(study_file, local_ray):
    """``runs_per_task``: each asynchronous arm (3 variants x 3 seeds) becomes three tasks of one seed; the joined
    results, tables and curves are the local run's, value for value."""
    study = studies.load(str(study_file))
    settings = dataclasses.replace(study.quick, seeds=(0, 1, 2))
    local = studies.run(study, settings=settings, progress=False)
    split = studies.run(study, settings=settings, progress=False, backend="ray", runs_per_task=3)
    _same(split, local)
    assert studies.format_table(study, split.runs, 3) == studies.format_table(study, local.runs, 3)


def test_an_arm_that_fails_for_its_own_reason_is_named(study_file, local_ray):
    import importlib.util

    spec = importlib.util.spec_from_file_location("broken_study", study_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(RuntimeError, match=r"arm 1 \(.*\) failed: ConfigError: .*lam"):
        studies.run(module.BROKEN, quick=True, progress=False, backend="ray")


def test_a_two_node_cluster_that_loses_a_node_gives_the_same_result(study_file, local_result, tmp_path, ray_temp_dir):
    from ray.cluster_utils import Cluster

    ray.shutdown()  # the local instance of the tests above: the cluster has its own
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    worker = cluster.add_node(num_cpus=1)
    try:
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        study = studies.load(str(study_file))
        out = tmp_path / "out"

        def lose_the_second_node(arm, runs, curves):
            if worker in cluster.worker_nodes:  # after the first arm: its tasks on that node die and are retried
                cluster.remove_node(worker)

        result = studies.run(study, quick=True, progress=False, backend="ray", out=out, on_arm=lose_the_second_node)
        _same(result, local_result)
        assert worker not in cluster.worker_nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_a_cluster_that_cannot_be_joined_is_one_line(study_file, monkeypatch, capsys):
    from asgd_jax.cli import main

    def unreachable(**kwargs):
        raise ConnectionError("Failed to connect to Ray cluster at 127.0.0.1:1")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", unreachable)
    argv = ["run", str(study_file), "--quick", "--no-progress", "--backend", "ray", "--ray-address", "auto"]
    assert main([*argv, "--out", str(study_file.parent / "out")]) == 2
    err = capsys.readouterr().err
    assert "ray_address='auto' (--ray-address) cannot be joined (ConnectionError: Failed to connect" in err
    assert len(err.strip().splitlines()) == 1
    argv[-1] = "127.0.0.1:1"  # a host:port where nothing listens: refused by the probe, before Ray is asked
    assert main([*argv, "--out", str(study_file.parent / "out2")]) == 2
    err = capsys.readouterr().err
    assert "ray_address='127.0.0.1:1' (--ray-address) cannot be reached" in err and len(err.strip().splitlines()) == 1
