"""A run folder belongs to one run, its trace to its checkpoint, and a replay applies exactly what the store applied.

Injected: a second run on a running run's folder, a trace with a garbage line, one worker id changed, another run's
trace in its place, NaN pushes the store rejected.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.problems import DATA, W0, W1, BatchOrder, lsq_loss, simulate_lsq

import asgd_jax
from asgd_jax import trace
from asgd_jax.cli import main
from asgd_jax.errors import ConfigError
from asgd_jax.plan import Plan
from asgd_jax.trainer import TrainConfig, session, train

GUARD = 300.0  # a run that hangs ends here, as a timeout, and fails the assertions


def _train(config, rule=None, data=DATA):
    rule = rule or asgd_jax.asgd(0.05)
    return train(lsq_loss, rule, W0, data, config, devices=jax.devices()[:2])


def _config(out, **kw):
    plan = dict(num_updates=20, batch_size=8, checkpoint_every=5)
    plan.update({k: kw.pop(k) for k in list(kw) if k in ("num_updates", "checkpoint_every")})
    return TrainConfig(Plan(2, **plan), seed=3, out=str(out), progress=False, timeout=GUARD, **kw)


# --------------------------------------------------------------------------------------------------------------------
# One run per folder
# --------------------------------------------------------------------------------------------------------------------


def test_a_folder_held_by_a_run_is_refused_to_a_second_one_naming_the_holder(tmp_path):
    with (
        session.RunLock(tmp_path),
        pytest.raises(ConfigError, match=rf"is in use by another run \(process {os.getpid()}\)"),
    ):
        _train(_config(tmp_path))
    assert not (tmp_path / "trace.jsonl").exists()  # the refused run wrote nothing
    result = _train(_config(tmp_path))  # released: the folder is free again
    assert result.pushes_applied == 20


def test_a_second_train_on_a_running_runs_folder_exits_2_in_one_line_and_the_first_is_untouched(tmp_path, capsys):
    out = tmp_path / "run"
    script = (
        "import sys; sys.path.insert(0, 'tests'); import jax, asgd_jax; "
        "from helpers.problems import DATA, W0, lsq_loss; from asgd_jax.trainer import TrainConfig, train; "
        f"train(lsq_loss, asgd_jax.asgd(0.05), W0, DATA, TrainConfig(asgd_jax.Plan(2, num_updates=10**7, batch_size=8),"
        f" out={str(out)!r}, progress=False, timeout=60.0))"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    first = subprocess.Popen([sys.executable, "-c", script], cwd=os.path.dirname(os.path.dirname(__file__)), env=env)
    try:
        trace_file = out / "trace.jsonl"
        for _ in range(6000):  # the first run is training once its trace has lines (bounded: 600 s at most)
            if first.poll() is not None or (trace_file.exists() and trace_file.stat().st_size > 0):
                break
            subprocess.run(["sleep", "0.1"], check=True)
        assert first.poll() is None, "the first run ended before the second started"
        argv = ["train", "--dataset", "digits", "--workers", "2", "--num-updates", "5", "--no-progress"]
        assert main([*argv, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"is in use by another run (process {first.pid})" in err and len(err.strip().splitlines()) == 1
        assert first.poll() is None  # still running, its files its own
    finally:
        first.kill()
        first.wait()
    assert (out / "plan.json").exists() and json.loads((out / "plan.json").read_text())["workers"] == 2


# --------------------------------------------------------------------------------------------------------------------
# The checkpoint pins its trace
# --------------------------------------------------------------------------------------------------------------------


def _resume(out):
    return _train(_config(out, num_updates=30, resume=True))


def test_a_garbage_line_in_the_middle_of_the_trace_is_refused_on_resume_naming_it(tmp_path):
    _train(_config(tmp_path))
    lines = (tmp_path / "trace.jsonl").read_text().splitlines(keepends=True)
    lines[7] = "this is not a record\n"
    (tmp_path / "trace.jsonl").write_text("".join(lines))
    with pytest.raises(ConfigError, match=r"trace\.jsonl:8: not a trace record"):
        _resume(tmp_path)


def test_one_changed_worker_id_is_refused_on_resume(tmp_path):
    _train(_config(tmp_path))
    lines = (tmp_path / "trace.jsonl").read_text().splitlines(keepends=True)
    record = json.loads(lines[3])
    record["worker"] = 1 - record["worker"]
    lines[3] = json.dumps(record) + "\n"
    (tmp_path / "trace.jsonl").write_text("".join(lines))
    with pytest.raises(ConfigError, match="not the ones the checkpoint was taken with"):
        _resume(tmp_path)


def test_another_runs_trace_with_the_same_flags_is_refused_on_resume(tmp_path):
    _train(_config(tmp_path / "a"))
    _train(_config(tmp_path / "b"))
    (tmp_path / "a" / "trace.jsonl").write_bytes((tmp_path / "b" / "trace.jsonl").read_bytes())
    with pytest.raises(ConfigError, match="the trace is another run's"):
        _resume(tmp_path / "a")
    with pytest.raises(ConfigError, match="the trace is another run's"):  # the same one line on the command line
        asgd_jax.trainer.persistence.check_resume(tmp_path / "a", json.loads(_header(tmp_path / "a")))


def _header(out) -> str:
    saved = np.load(out / "checkpoint.npz")
    header = json.loads(bytes(saved["__header__"]).decode())
    keys = (
        "num_workers",
        "mode",
        "n_sync",
        "batch_size",
        "push",
        "key",
        "local_lr",
        "devices_per_worker",
        "rule_probe",
    )
    return json.dumps({k: header[k] for k in (*keys, "data")})


def test_the_untouched_trace_resumes_and_the_whole_run_replays(tmp_path):
    _train(_config(tmp_path))
    result = _resume(tmp_path)
    assert result.resumed_from == 20 and result.pushes_applied == 30
    replay = asgd_jax.simulate(
        lsq_loss,
        asgd_jax.asgd(0.05),
        W0,
        DATA,
        asgd_jax.trainer.replay_plan(tmp_path),
        key=jax.random.key(3),
        progress=False,
    )
    np.testing.assert_allclose(replay.params, result.params, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------------------------
# Rejected pushes: traced, and skipped by the replay
# --------------------------------------------------------------------------------------------------------------------


def test_a_run_with_rejected_nan_pushes_replays_to_the_trainers_finite_weights(tmp_path):
    poisoned = {"x": DATA["x"].copy(), "y": DATA["y"]}
    poisoned["x"][[5, 50]] = np.nan  # one minibatch of each worker's shard per epoch holds NaN
    config = _config(tmp_path, num_updates=60, checkpoint_every=None, max_nonfinite=1000)
    result = _train(config, data=poisoned)
    assert result.pushes_rejected > 0 and result.pushes_applied == 60
    assert np.isfinite(result.params).all()
    records = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    nonfinite = result.pushes_rejected - result.pushes_late  # late pushes (after the budget) are not traced
    assert sum(r.get("rejected", False) for r in records) == nonfinite > 0
    assert sum(not r.get("rejected", False) for r in records) == 60
    plan = asgd_jax.trainer.replay_plan(tmp_path)
    # Every rejected push is skipped before its worker's next applied one (a worker's last ones have none after them).
    assert plan.delays.skips is not None and 0 < int(plan.delays.skips.sum()) <= nonfinite
    replay = asgd_jax.simulate(lsq_loss, asgd_jax.asgd(0.05), W0, poisoned, plan, key=jax.random.key(3), progress=False)
    assert np.isfinite(np.asarray(replay.params)).all()
    np.testing.assert_allclose(replay.params, result.params, rtol=1e-5, atol=1e-6)


def test_a_skip_is_that_workers_minibatches_used_up_and_nothing_else():
    """A replayed skip of k is k exchange periods of the pushing worker's shard used up, no weight moved, no new pull:
    the same as k pushes with a zero learning rate made right after that worker's previous push (they pull the very
    weights it already holds)."""
    skipped = asgd_jax.delays.Trace([0, 1, 0, 0, 1, 1, 0], num=2, skips=[0, 0, 2, 0, 1, 0, 0])
    expanded = asgd_jax.delays.Trace([0, 0, 0, 1, 1, 0, 0, 1, 1, 0], num=2)
    lr = jnp.where(jnp.asarray([0, 1, 1, 0, 1, 0, 0, 0, 0, 0]) == 1, 0.0, 0.05)
    run = lambda rule, delays, n: asgd_jax.simulate(
        lsq_loss, rule, W0, DATA, Plan(delays, batch_size=8, num_updates=n), key=jax.random.key(1), progress=False
    )
    a = run(asgd_jax.asgd(0.05), skipped, 7)
    b = run(asgd_jax.asgd(lambda count: lr[count]), expanded, 10)
    np.testing.assert_allclose(a.params, b.params, rtol=1e-6, atol=1e-7)
    c = run(asgd_jax.asgd(0.05), asgd_jax.delays.Trace([0, 1, 0, 0, 1, 1, 0], num=2), 7)
    assert not np.allclose(a.params, c.params)  # the skips changed which minibatches were used


def test_a_trace_of_pulled_versions_replays_each_gradient_at_its_version():
    """A Ringmaster run's trace (a stale push ignored, a stopped computation restarted at the current weights): each
    update t applies the gradient at w_{pulled[t]} on its worker's next minibatch (after its skips); a float64 NumPy
    loop of exactly that agrees with the simulator's ring of versions, whose staleness is t - pulled[t]."""
    ids = [0, 1, 2, 1, 0, 2, 2, 1, 0, 1]
    pulled = [0, 0, 1, 2, 2, 3, 6, 4, 5, 8]
    skips = [0, 0, 1, 0, 0, 0, 2, 0, 1, 0]
    lr, n = 0.05, len(ids)
    model = asgd_jax.delays.Trace(ids, num=3, skips=skips, pulled=pulled)
    assert model.num_slots == 4  # the largest staleness, 3 (updates 7 and 8), + 1
    order = BatchOrder(5, num_shards=3)
    versions = [W1.astype(np.float64)]
    for t, (w, v, k) in enumerate(zip(ids, pulled, skips, strict=True)):
        for _ in range(k):
            order.next(w)
        x, y = order.next(w)
        g = x.T @ (x @ versions[v] - y) / len(y)
        versions.append(versions[t] - lr * g)
    sim = simulate_lsq(asgd_jax.asgd(lr), model, num_updates=n, key=5)
    np.testing.assert_allclose(sim.params, versions[-1], rtol=2e-5, atol=1e-6)
    np.testing.assert_array_equal(sim.metrics["staleness"], np.arange(n) - np.asarray(pulled))
    np.testing.assert_array_equal(sim.metrics["worker"], ids)


def test_a_ring_replay_of_own_pulls_equals_the_per_worker_replay():
    ids = [0, 1, 1, 0, 2, 0, 1, 2]
    own, last = [], {}
    for t, w in enumerate(ids):
        own.append(last.get(w, 0))
        last[w] = t + 1
    per_worker = simulate_lsq(asgd_jax.dc_asgd(0.05, 0.5), asgd_jax.delays.Trace(ids, num=3), num_updates=8)
    ring = simulate_lsq(asgd_jax.dc_asgd(0.05, 0.5), asgd_jax.delays.Trace(ids, num=3, pulled=own), num_updates=8)
    np.testing.assert_allclose(ring.params, per_worker.params, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(ring.metrics["staleness"], per_worker.metrics["staleness"])


def test_trace_records_are_type_checked(tmp_path):
    path = tmp_path / "trace.jsonl"
    good = trace.Record(worker=1, workers=2, pulled_version=0, applied_version=1, staleness=0, time=0.5).line()
    for bad, message in (
        ('{"worker": 1.7, "workers": 2}\n', r"worker=1\.7 is not an int"),
        ('{"worker": true, "workers": 2}\n', r"worker=True is not an int"),
        ('{"worker": 1, "workers": 3}\n', "workers=3, but the records before it say 2"),
        ('{"worker": 5, "workers": 2}\n', "worker=5 is not below the run's 2 workers"),
        ('{"worker": 0, "workers": 2, "time": "soon"}\n', "time='soon' is not a finite number"),
        ('{"worker": 0, "workers": 2, "rejected": 1}\n', "rejected=1 is not true or false"),
        ("[1, 2]\n", "not a trace record with a 'worker' field"),
    ):
        path.write_text(good + bad + good)
        with pytest.raises(ConfigError, match=message):
            asgd_jax.delays.Trace.load(path)
    folder = tmp_path / "a_folder"
    folder.mkdir()
    with pytest.raises(ConfigError, match="is not a readable trace"):
        asgd_jax.delays.Trace.load(folder)


# --------------------------------------------------------------------------------------------------------------------
# The wind-down does not wait for a sleeping straggler; a refused resume on Ray starts nothing
# --------------------------------------------------------------------------------------------------------------------


def test_a_straggler_asleep_for_days_does_not_hold_the_end_of_the_run(tmp_path):
    """Worker 1's artificial sleep is a billion times its compute time: the run ends when the budget is reached (in a
    process of its own, so that a regression fails here at its timeout instead of hanging the suite)."""
    script = (
        "import sys; sys.path.insert(0, 'tests'); import jax, asgd_jax; "
        "from helpers.problems import DATA, W0, lsq_loss; from asgd_jax.trainer import TrainConfig, train; "
        "r = train(lsq_loss, asgd_jax.asgd(0.05), W0, DATA, TrainConfig(asgd_jax.Plan(2, num_updates=50, "
        f"batch_size=8), slowdown={{1: 1e9}}, out={str(tmp_path)!r}, progress=False)); print('ENDED', r.ended)"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    run = subprocess.run(
        [sys.executable, "-c", script],
        cwd=os.path.dirname(os.path.dirname(__file__)),
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert "ENDED finished" in run.stdout, run.stdout + run.stderr
    records = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert len(records) == 50 and {r["worker"] for r in records} == {0}  # the sleeper never pushed


def test_a_refused_resume_on_ray_is_one_line_before_any_actor(tmp_path, monkeypatch):
    pytest.importorskip("ray")
    import ray

    from asgd_jax.trainer import ray_backend

    _train(_config(tmp_path))
    monkeypatch.setattr(ray_backend, "run", lambda *a, **k: pytest.fail("an actor was started"))
    ray_config = _config(tmp_path, num_updates=30, resume=True).replace(backend="ray")
    with pytest.raises(ConfigError, match="rule_probe: checkpoint"):  # another learning rate
        _train(ray_config, rule=asgd_jax.asgd(0.5))
    (tmp_path / "trace.jsonl").unlink()
    with pytest.raises(ConfigError, match=r"trace\.jsonl is missing"):
        _train(ray_config)
    assert not ray.is_initialized()


def test_recorded_rounds_replay_as_the_mean_of_their_payloads_at_w_t():
    """A trainer's Rennala or m-Synchronous run comes back as rounds: update t is the mean, in the recorded order, of
    its workers' gradients at w_t, each on that worker's next minibatch after its skips (a worker twice in a round
    takes two in a row). A float64 NumPy loop of exactly that agrees with the simulator."""
    shards = [[2, 0], [1, 1], [0, 2], [1, 0]]
    skips = [[0, 0], [1, 0], [0, 2], [0, 0]]
    lr = 0.1
    model = asgd_jax.delays.RoundTrace(shards, skips, num=3)
    order = BatchOrder(7, num_shards=3)
    w = W1.astype(np.float64)
    for round_shards, round_skips in zip(shards, skips, strict=True):
        grads = []
        for s, k in zip(round_shards, round_skips, strict=True):
            for _ in range(k):
                order.next(s)
            x, y = order.next(s)
            grads.append(x.T @ (x @ w - y) / len(y))
        w = w - lr * np.mean(grads, axis=0)
    sim = simulate_lsq(asgd_jax.rules.get("sgd", lr), model, num_updates=4, key=7)
    np.testing.assert_allclose(sim.params, w, rtol=2e-5, atol=1e-6)
    assert sim.plan.mode == "sync" and (sim.metrics["staleness"] == 0).all()
    with pytest.raises(ConfigError, match="holds only 4 rounds"):
        asgd_jax.Plan(model, num_updates=5)


def test_a_ray_address_where_nothing_listens_fails_at_once_naming_it(monkeypatch):
    """#34 item 10: Ray retries an address where nothing listens for minutes; the probe refuses it first."""
    import socket

    from asgd_jax import ray_cluster

    class NoRay:
        def is_initialized(self):
            return False

        def init(self, **kwargs):
            pytest.fail(f"ray.init was called with {kwargs}")

    monkeypatch.setattr(ray_cluster, "require_ray", NoRay)
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        with pytest.raises(
            ConfigError, match=rf"ray_address='{address}' \(--ray-address\) cannot be reached.*ray start"
        ):
            ray_cluster.join(address)
    with socket.socket() as listening:  # something answers: the probe lets Ray take over
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert ray_cluster.unreachable(f"127.0.0.1:{listening.getsockname()[1]}") is None
    assert ray_cluster.unreachable("auto") is None


def test_a_resumed_sessions_trace_times_go_on_from_the_last_kept_record(tmp_path):
    """A trace's times are the run's clock: a resumed session's records continue from the last record it keeps (its
    store's clock restarts at zero), so that a replay's virtual time never goes back either."""
    from asgd_jax.trainer.ledger import Ledger

    kept = [trace.Record(w, 2, v, v + 1, 0, 100.0 + v) for v, w in enumerate([0, 1, 0])]
    (tmp_path / trace.FILE).write_text("".join(r.line() for r in kept) + '{"worker": 1, "wor')  # a cut last line
    ledger = Ledger(2, tmp_path, lambda what, e: None)
    ledger.open_trace(3, None)
    ledger.applied = 3
    ledger.applied_push(1, 3, 0, None)
    ledger.trace.close()
    times = [r["time"] for r in map(json.loads, (tmp_path / trace.FILE).read_text().splitlines())]
    assert times[:3] == [100.0, 101.0, 102.0] and 102.0 <= times[3] < 102.0 + 60, times
    assert trace.Writer(tmp_path / trace.FILE, 4).last_time == times[3]


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_files_written_whole_have_the_modes_of_any_file_the_process_makes(tmp_path, umask):
    """checkpoint.npz, summary.json, a study's results: written to a temporary file and renamed, which made them the
    owner's alone (0600) whatever the umask; a group sharing a results folder could not read them."""
    script = (
        "import os, sys; os.umask(int(sys.argv[1], 8))\n"
        "from asgd_jax import checkpoint\n"
        "checkpoint.write_json(sys.argv[2] + '/a.json', {'x': 1})\n"
        "open(sys.argv[2] + '/b.txt', 'w').close()\n"
    )
    subprocess.run([sys.executable, "-c", script, oct(umask), str(tmp_path)], check=True)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes == {"a.json": 0o666 & ~umask, "b.txt": 0o666 & ~umask}
