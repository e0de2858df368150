"""Heterogeneous data: a partition is drawn once from its own seed, every worker reads only its own examples (in the
simulator and in the trainer's loaders alike), every partition of the same data runs in the same programs, and a
trainer run on a non-IID partition replays to its weights.

hypothesis draws the labels, the partition and the cluster; bad text and partitions that cannot fill a minibatch are
refused before anything compiles.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.compiles import compilations
from hypothesis import given, settings
from hypothesis import strategies as st

import asgd_jax
from asgd_jax import delays, order, partition
from asgd_jax.cli import main
from asgd_jax.errors import ConfigError
from asgd_jax.partition import Partition
from asgd_jax.plan import Plan
from asgd_jax.trainer.loader import ShardLoader

SETTINGS = settings(max_examples=40, deadline=None)

# A four-class problem whose loss's gradient counts the classes of a minibatch: -mean(w[y]) moves w[c] by lr * (the
# share of class c in the minibatch), so the weights after a run say exactly which examples were read.
CLASSES, N = 4, 96
_rng = np.random.default_rng(0)
LABELS = np.repeat(np.arange(CLASSES), N // CLASSES).astype(np.int32)
COUNTS = {"x": _rng.normal(size=(N, 3)).astype(np.float32), "y": LABELS}


def count_loss(w, batch):
    return -jnp.mean(w[batch["y"]])


# A softmax regression on the same data: what a trainer run of a real model looks like, in miniature.
W_SOFTMAX = np.zeros((3, CLASSES), np.float32)


def softmax_loss(w, batch):
    logits = batch["x"] @ w
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(len(batch["y"])), batch["y"]])


kinds = st.one_of(
    st.floats(0.05, 100.0).map(Partition.dirichlet),
    st.integers(1, CLASSES).map(Partition.labels_per_worker),
    st.floats(0.5, 100.0).map(Partition.unequal),
)


@SETTINGS
@given(
    p=kinds,
    seed=st.integers(0, 2**31 - 1),
    classes=st.integers(1, 6),
    per_class=st.integers(4, 60),
    workers=st.integers(1, 6),
    batch=st.integers(1, 8),
)
def test_a_drawn_partition_gives_each_worker_its_own_examples(p, seed, classes, per_class, workers, batch):
    p = Partition(p.kind, p.value, seed)
    labels = np.random.default_rng(seed).permutation(np.repeat(np.arange(classes), per_class))
    try:
        a = p.assign(labels, workers, batch)
    except ConfigError as e:  # refused only for its stated reasons
        assert str(p) in str(e) or "classes" in str(e)
        return
    lists = [a.of(w) for w in range(workers)]
    everyone = np.concatenate(lists)
    assert len(np.unique(everyone)) == len(everyone)  # disjoint
    assert everyone.min() >= 0 and everyone.max() < len(labels)
    assert (a.sizes >= batch).all() and a.members.shape == (len(labels),)
    if p.kind in ("dirichlet", "unequal"):
        assert len(everyone) == len(labels)  # every example belongs to somebody
    if p.kind == "labels":
        assert all(len(np.unique(labels[x])) <= p.value for x in lists)
    again = p.assign(labels, workers, batch)  # a pure function of the partition, labels and cluster
    assert all(np.array_equal(x, y) for x, y in zip(a, again, strict=True))


@SETTINGS
@given(p=kinds, seed=st.integers(0, 10**6))
def test_the_text_form_reads_back_as_the_same_partition(p, seed):
    p = Partition(p.kind, p.value, seed)
    assert Partition.parse(str(p)) == p and eval(repr(p), {"Partition": Partition.parse}) == p
    assert Partition.parse("iid") == Partition() == Partition.parse(None) and Partition().iid


@SETTINGS
@given(
    text=st.one_of(
        st.sampled_from(["", " ", "dirichlet", "dirichlet:", "dirichlet:x", "labels:1.5", "iid:1", "a:b:c:d"]),
        st.sampled_from(["dirichlet:0", "dirichlet:-1", "dirichlet:nan", "dirichlet:inf", "unequal:0", "labels:0"]),
        st.sampled_from(["dirichlet:0.1:-1", "dirichlet:0.1:x", "labels:2:1:1", "gaussian:1"]),
        st.text(max_size=6).filter(lambda t: t.strip().split(":")[0] not in partition.KINDS),
        st.integers(),
        st.floats(),
    )
)
def test_bad_partitions_are_refused_by_name(text):
    with pytest.raises(ConfigError, match=r"partition|alpha|beta|labels per worker"):
        Plan(4, partition=text)


def test_a_partition_that_cannot_fill_a_minibatch_is_refused_before_anything_compiles():
    plan = Plan(delays.Workers(4), num_updates=10, batch_size=30, partition="labels:1")  # 24 examples a worker
    with compilations() as counts, pytest.raises(ConfigError, match=r"labels:1.*leaves a worker 24 examples.*30"):
        asgd_jax.simulate(count_loss, asgd_jax.asgd(0.1), np.zeros(CLASSES, np.float32), COUNTS, plan, progress=False)
    with pytest.raises(ConfigError, match=r"labels per worker.*the data has 4 classes"):
        partition.assignment(Partition.parse("labels:5"), COUNTS, 4, 2)
    with pytest.raises(ConfigError, match=r"data\['y'\]"):
        partition.assignment(Partition.parse("dirichlet:1"), {"x": COUNTS["x"]}, 4, 2)
    with pytest.raises(ConfigError, match="one data stream"):
        Plan(delays.FixedDelay(3), partition="dirichlet:0.1")
    assert not {k: v for k, v in counts.items() if k.startswith("simulator_")}


def test_a_workers_epoch_reads_every_one_of_its_examples_once_in_a_fresh_order():
    a = Partition.unequal(2.0, seed=3).assign(LABELS, 3, 4)
    words = order.key_words(jax.random.key(1))
    for w in range(3):
        per_epoch = int(a.sizes[w]) // 4
        taken = jnp.arange(2 * per_epoch, dtype=jnp.int32)
        rows = np.asarray(partition.batch_indices(words, a, 4, jnp.full_like(taken, w), taken))
        first, second = rows[:per_epoch].ravel(), rows[per_epoch:].ravel()
        assert len(set(first.tolist())) == per_epoch * 4 and set(first.tolist()) <= set(a.of(w).tolist())
        assert set(second.tolist()) <= set(a.of(w).tolist()) and not np.array_equal(first, second)
        if int(a.sizes[w]) % 4 == 0:
            assert sorted(first.tolist()) == sorted(a.of(w).tolist())


def test_in_the_simulator_every_worker_reads_only_its_own_classes():
    """Under ``labels:1`` worker w holds class w alone, so each push moves w[its worker] by exactly the learning rate:
    the weights are the learning rate times each worker's pushes. Under IID every push moves every class a little."""
    plan = Plan(delays.Workers(4, speeds=np.array([1.0, 2.0, 3.0, 4.0])), num_updates=100, batch_size=4)
    w0 = np.zeros(CLASSES, np.float32)
    run = lambda p: asgd_jax.simulate(
        count_loss, asgd_jax.asgd(0.5), w0, COUNTS, plan.replace(partition=p), progress=False
    )
    fixed = run("labels:1")
    pushes = np.bincount(np.asarray(fixed.metrics["worker"]), minlength=CLASSES)
    assert pushes.sum() == 100 and len(set(pushes.tolist())) > 1  # the workers' speeds differ
    np.testing.assert_allclose(fixed.params, 0.5 * pushes, rtol=1e-6)
    mixed = run("iid")
    assert not np.allclose(mixed.params, 0.5 * pushes)


def test_a_partitioned_run_is_deterministic_and_each_partition_is_its_own_number():
    # The assignment is an argument of the programs: other partitions of the same data, another seed of the same
    # partition, other kinds, compile nothing new (IID, with no assignment, is another structure).
    asgd_jax.simulator.clear_cache()
    plan = Plan(delays.Workers(4), num_updates=60, batch_size=4)
    finals = {}
    with compilations() as counts:
        for p in ["dirichlet:0.1", "dirichlet:0.1", "dirichlet:0.1:1", "labels:2", "unequal:1", "dirichlet:100"]:
            result = asgd_jax.simulate(
                softmax_loss, asgd_jax.dc_asgd(0.1, 0.04), W_SOFTMAX, COUNTS, plan.replace(partition=p), progress=False
            )
            bits = np.asarray(result.params).tobytes()
            assert finals.setdefault(p, bits) == bits  # the same partition: identical bits
    assert len(set(finals.values())) == 5  # every partition its own run
    simulator = {k: v for k, v in counts.items() if k.startswith("simulator_")}
    assert simulator["simulator_start"] == 1 and set(simulator.values()) == {1}, counts


def test_a_sweep_runs_every_seed_on_the_one_partition():
    plan = Plan(delays.Workers(4), num_updates=40, batch_size=4, partition="labels:1")
    w0 = np.zeros(CLASSES, np.float32)
    keys = jax.random.split(jax.random.key(0), 3)
    sweep = asgd_jax.sweep(count_loss, asgd_jax.asgd(0.5), w0, COUNTS, plan, keys=keys, progress=False)
    for params, workers in zip(np.asarray(sweep.params), np.asarray(sweep.metrics["worker"]), strict=True):
        np.testing.assert_allclose(params, 0.5 * np.bincount(workers, minlength=CLASSES), rtol=1e-6)


def test_the_trainers_loader_reads_the_simulators_minibatches():
    a = Partition.dirichlet(0.5).assign(LABELS, 3, 4)
    key = jax.random.key(7)
    words = order.key_words(asgd_jax.exchange.split_key(key)[0])
    for w in range(3):
        with ShardLoader(COUNTS, worker=w, num_workers=3, batch_size=4, key=key, assignment=a) as loader:
            got = [loader.indices(j) for j in range(12)]
        taken = jnp.arange(12, dtype=jnp.int32)
        want = np.asarray(partition.batch_indices(words, a, 4, jnp.full_like(taken, w), taken))
        np.testing.assert_array_equal(np.stack(got), want)
        assert loader.per_epoch == int(a.sizes[w]) // 4


@pytest.mark.parametrize("backend_devices", [2])
def test_a_trainer_run_on_a_dirichlet_partition_replays_to_its_weights(tmp_path, backend_devices):
    plan = Plan(2, num_updates=40, batch_size=4, partition="dirichlet:0.3:2")
    config = asgd_jax.TrainConfig(plan, seed=5, out=str(tmp_path), progress=False, timeout=300.0)
    rule = asgd_jax.dc_asgd(0.1, 0.04)
    result = asgd_jax.train(softmax_loss, rule, W_SOFTMAX, COUNTS, config, devices=jax.devices()[:backend_devices])
    assert result.pushes_applied == 40
    replay_plan = asgd_jax.trainer.replay_plan(tmp_path)
    assert replay_plan.partition == Partition.dirichlet(0.3, seed=2)
    replay = asgd_jax.simulate(
        softmax_loss, rule, W_SOFTMAX, COUNTS, replay_plan, key=jax.random.key(5), progress=False
    )
    np.testing.assert_allclose(replay.params, result.params, rtol=1e-5, atol=1e-6)
    iid = asgd_jax.simulate(
        softmax_loss,
        rule,
        W_SOFTMAX,
        COUNTS,
        replay_plan.replace(partition="iid"),
        key=jax.random.key(5),
        progress=False,
    )
    assert not np.allclose(iid.params, result.params, rtol=1e-3)  # the partition, not chance, made the weights


def test_the_iid_default_leaves_every_existing_run_alone():
    plan = Plan(delays.Workers(4), num_updates=30, batch_size=4)
    assert plan.partition == Partition() and plan.describe()["partition"] == "iid"
    assert plan.structure().fixed_partition is False and plan.replace(partition="unequal:1").structure().fixed_partition
    assert math.isclose(Partition.parse("dirichlet:0.1").alpha, 0.1) and Partition.parse("labels:2").alpha is None


def test_the_command_line_trains_on_a_partition_and_records_it(tmp_path, capsys):
    argv = ["train", "--dataset", "digits", "--model", "mlp", "--workers", "2", "--lr", "0.05", "--no-progress"]
    assert main([*argv, "--num-updates", "20", "--partition", "labels:3:1", "--out", str(tmp_path)]) == 0
    assert asgd_jax.trainer.replay_plan(tmp_path).partition == Partition.labels_per_worker(3, seed=1)
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--partition", "labels:0", "--out", str(tmp_path / "bad")])
    assert exit_info.value.code == 2 and "labels per worker" in capsys.readouterr().err


def test_a_study_arm_runs_on_its_plans_partition_every_seed_on_the_same_one():
    from asgd_jax import studies

    tiny = studies.Settings(dataset="digits", seeds=(0, 1), epochs=2.0, evals=2, window=10)
    arms = lambda s, q: [
        studies.Arm({"data": p}, Plan(4, partition=p), variants=(studies.Variant("ASGD", rule="asgd"),))
        for p in ("iid", "labels:1", "dirichlet:0.1")
    ]
    study = studies.Study(name="t", title="t", reproduces="", quick=tiny, full=tiny, arms=arms)
    first, second = (studies.run(study, settings=tiny, progress=False) for _ in range(2))
    assert first.runs == second.runs  # bit for bit
    error = {(r["data"], r["seed"]): r["test_error"] for r in first.runs}
    assert error["iid", 0] != error["iid", 1] and error["dirichlet:0.1", 0] != error["dirichlet:0.1", 1]
    # One class a worker: four workers see four of the ten classes, the model cannot learn the other six.
    assert min(error["labels:1", s] for s in (0, 1)) > max(error["iid", s] for s in (0, 1)) + 0.4


def test_the_heterogeneous_data_study_gives_every_cell_its_partition_and_the_methods_their_clusters():
    from asgd_jax import rules, studies

    study = studies.load("heterogeneous_data")
    arms = study.arms(study.quick, True)
    cells = {(a.coords["M"], a.coords["data"]) for a in arms if a.coords["M"] != "—"}
    assert cells == {(m, d) for m in (4, 16) for d in ("IID", "Dirichlet 0.1")}
    for arm in arms:
        labels = {v.label for v in arm.variants}
        data = arm.coords["data"]
        assert str(arm.plan.partition) == {"IID": "iid", "Dirichlet 0.1": "dirichlet:0.1", "—": "iid"}[data]
        assert isinstance(arm.plan.delays, delays.Malenia) == (labels == {"Malenia"})
        assert all(v.rule in rules.names() for v in arm.variants)
    labels = {v.label for a in arms for v in a.variants}
    assert {"ASGD", "DC-ASGD-a", "IA²SGD", "Ringleader", "Malenia", "SSGD", "SGD (1 worker)"} <= labels
    assert {"staleness-aware", "delay-adaptive", "Gap-Aware", "Ringmaster (stops)", "Rennala (stops)"} <= labels
    # A tiny form runs end to end, with the methods of this study's own (Ringleader, Malenia's cluster) beside the
    # one-worker baseline, and in the Dirichlet cell the synchronous and round schedules (SSGD, Rennala): every
    # method is a program of its own to compile (~1 s each on 2 cores), and the push rules' mix is the leaderboard's.
    tiny = dataclasses.replace(study.quick, dataset="digits", seeds=(0,), epochs=1.0, workers=(4,), evals=2)
    own, skewed = {"SGD (1 worker)", "Ringleader", "Malenia"}, {"SSGD", "Rennala (stops)"}
    kept = lambda a: {v.label for v in a.variants} & (own | (skewed if a.coords["data"] == "Dirichlet 0.1" else set()))
    theirs = dataclasses.replace(study, arms=lambda s, q: [a for a in study.arms(s, q) if kept(a)])
    result = studies.run(theirs, settings=tiny, progress=False)
    assert {r["label"] for r in result.runs} == own | skewed
    assert {r["data"] for r in result.runs} == {"IID", "Dirichlet 0.1"}  # (the one-worker runs in every column)
    assert all(np.isfinite(r["test_error"]) for r in result.runs)
