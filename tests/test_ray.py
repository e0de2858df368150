"""The Ray backend on a local Ray instance (loopback only): same trace, same counts, workers and the store can die."""

from __future__ import annotations

import inspect
import json
import pathlib
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import problems as lsq_problem
from helpers.problems import (
    BIG,
    DATA,
    W0,
    SlowColumn,
    big_loss,
    lsq_loss,
    replay_clean,
    simulate_clean,
    train_config,
)

import asgd_jax
from asgd_jax.plan import Plan
from asgd_jax.trainer import TrainConfig, train
from asgd_jax.trainer.loader import ShardLoader

ray = pytest.importorskip("ray")

LIMIT = 1200  # seconds a run may take (its TrainConfig.timeout): a bound for a hung run, not a speed requirement

# One Ray instance for all of them (xdist's loadgroup): two on a 2-core machine starve each other.
pytestmark = pytest.mark.xdist_group("ray")


def rule():
    return asgd_jax.dc_asgd(0.02, 2.0, adaptive=True)


@pytest.fixture(scope="module")
def local_ray(ray_temp_dir):
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False)
    for module in (sys.modules[__name__], lsq_problem):  # the workers cannot import the test modules
        ray.cloudpickle.register_pickle_by_value(module)
    yield ray
    ray.shutdown()


@pytest.fixture(autouse=True)
def _room_for_the_next_run(local_ray):
    """After a test, wait until its killed actors have given their CPUs back (slow on a loaded machine): the next
    run's workers would otherwise wait for room."""
    yield
    deadline = time.time() + 120
    while time.time() < deadline and local_ray.available_resources().get("CPU", 0) < 2:
        time.sleep(0.2)


def replay(trace_path, steps, num=2):
    trace = asgd_jax.delays.Trace.load(trace_path, num=num)
    assert len(trace) == steps
    return simulate_clean(rule(), trace, steps).params


def _train_in_thread(loss=lsq_loss, params=W0, the_rule=None, **kwargs):
    box = {"before": set(ray.util.list_named_actors())}  # actors of earlier runs may still be on their way out

    def target():
        try:
            box["result"] = train(
                loss,
                the_rule or rule(),
                params,
                DATA,
                train_config(2, batch_size=4, seed=3, backend="ray", timeout=LIMIT, **kwargs),
            )
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    box["thread"] = thread
    return thread, box


def _result(thread: threading.Thread, box: dict):
    """The run's result once its thread is done, or the test fails with the run's error."""
    thread.join(timeout=LIMIT + 60)
    return box.get("result") or pytest.fail(f"training failed: {box.get('error')!r}")


def _kill_when(trace: pathlib.Path, lines: int, role: str, box: dict, pusher: int | None = None) -> int:
    """Kills this run's ``role`` actor once the trace has ``lines`` lines and, for a worker, one push of its own.

    A worker must have pushed: one killed while still in its constructor is restarted by Ray before its ``run`` task is
    sent, so nothing fails and nothing is reported (what CI's faster machine once hit with a bare line count). In sync
    mode every update is recorded as worker 0's (``pusher=0``): any update means every worker has pushed."""
    worker = int(role.rsplit("-", 1)[1]) if role.startswith("worker-") else None
    worker = worker if pusher is None else pusher
    while box["thread"].is_alive():  # no clock: a loaded machine only makes it slower
        complete = trace.read_text().split("\n")[:-1] if trace.exists() else []  # the last line may be half-written
        records = [json.loads(line) for line in complete]
        if len(records) >= lines and (worker is None or any(r["worker"] == worker for r in records)):
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the run ended before the trace had {lines} lines with a push from {role}: {box.get('error')!r}")
    names = [n for n in ray.util.list_named_actors() if n.endswith("/" + role) and n not in box["before"]]
    assert len(names) == 1, f"expected one live actor {role}, found {names}"
    ray.kill(ray.get_actor(names[0]), no_restart=False)
    return len(records)  # at most this many updates had been applied when the kill was sent


def test_ray_backend_trace_replays_and_counts_add_up(local_ray, tmp_path):
    result = train(
        lsq_loss,
        rule(),
        W0,
        DATA,
        TrainConfig(
            Plan(2, num_updates=40, batch_size=4, eval_every=10),
            seed=3,
            backend="ray",
            out=str(tmp_path),
            log_every=0.05,
        ),
        eval_fn=lambda w, _: {"loss": lsq_loss(w, DATA)},
    )
    assert result.pushes_applied == 40 and result.pushes_sent == result.pushes_applied + result.pushes_rejected
    assert not result.failures and sum(w.pushes for w in result.workers) == result.pushes_sent
    np.testing.assert_allclose(replay(result.trace_path, 40), result.params, rtol=1e-5, atol=1e-6)
    # Evaluations at every 10th update, of the server's weights right then (the simulator's after 10, 20, ... updates).
    assert [e["update"] for e in result.evals] == [10, 20, 30, 40]
    trace = asgd_jax.delays.Trace.load(result.trace_path, num=2)
    for e in result.evals:
        w = asgd_jax.simulate(
            lsq_loss,
            rule(),
            jnp.asarray(W0),
            DATA,
            asgd_jax.Plan(trace, batch_size=4, num_updates=e["update"]),
            key=jax.random.key(3),
            progress=False,
        ).params
        np.testing.assert_allclose(e["loss"], lsq_loss(w, DATA), rtol=1e-4)
    # metrics.jsonl as the threaded backend writes it: every applied push in exactly one histogram, a final record.
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in records if r["kind"] == "eval"] == [10, 20, 30, 40]
    assert records[-1]["kind"] == "final" and records[-1]["applied"] == 40
    # Each evaluation's time is when the store actor (another process) took its weights, on the driver's clock.
    evals, others = [r for r in records if r["kind"] == "eval"], [r for r in records if r["kind"] != "eval"]
    assert [e["time"] for e in evals] == sorted(e["time"] for e in evals) and evals[0]["time"] >= 0
    assert all(e["time"] <= r["time"] for e in evals for r in others if r["applied"] >= e["update"])
    assert sum(n for r in records if r["kind"] != "eval" for n in r["staleness_histogram"].values()) == 40
    assert dict(result.staleness_counts) == {int(k): v for k, v in _histogram(records).items()}


def _histogram(records):
    total = {}
    for r in records:
        for k, n in r.get("staleness_histogram", {}).items() if r["kind"] != "eval" else ():
            total[k] = total.get(k, 0) + n
    return total


def test_ringmaster_with_stops_on_ray_stops_the_straggler_and_replays(local_ray, tmp_path):
    """The worker loop's stops over the store actor's link: a worker 10^6 x slower is stopped (it waits on the store
    actor's version) and restarts at the current weights; none of its pushes is applied; the trace replays. Every
    minibatch read takes 50 ms (SlowColumn): the fast worker's 30 updates last 1.5 s at least, a margin of that much
    for the straggler's actor to start its first computation (on a loaded machine, without it, the fast worker once
    finished first). Actors are processes of their own: no in-process gate as the threaded tests have."""
    plan = Plan(asgd_jax.delays.Ringmaster(2, 2, stops=True), num_updates=30, batch_size=4)  # the 2 CPUs' 2 actors
    config = TrainConfig(plan, seed=3, backend="ray", out=str(tmp_path), slowdown={0: 1e6}, timeout=LIMIT)
    result = train(lsq_loss, rule(), W0, {"x": SlowColumn(DATA["x"]), "y": DATA["y"]}, config)
    assert result.pushes_applied == 30 and result.workers[0].stopped >= 1
    assert result.pushes_sent == result.pushes_applied + result.pushes_rejected + result.pushes_ignored
    lines = [json.loads(x) for x in pathlib.Path(result.trace_path).read_text().splitlines()]
    assert not any(x["worker"] == 0 for x in lines)
    assert max(x["staleness"] for x in lines if not x.get("ignored")) < 2
    replayed = replay_clean(tmp_path, rule(), seed=3)
    np.testing.assert_allclose(replayed.params, result.params, rtol=1e-6, atol=1e-7)


def test_m_synchronous_on_ray_stops_the_straggler_at_each_round_and_replays(local_ray, tmp_path):
    """Rounds gathered by the store actor: m = 1 of 2 workers, the other 10^6 x slower, stopped at every round's end
    over the actor link; every round is worker 1's, and the recorded rounds replay (slow minibatch reads, 50 ms each:
    a second's margin for the straggler to start before the last round, as in the Ringmaster test above)."""
    plan = Plan(asgd_jax.delays.MSync(2, 1), num_updates=20, batch_size=4)
    config = TrainConfig(plan, seed=3, backend="ray", out=str(tmp_path), slowdown={0: 1e6}, timeout=LIMIT)
    result = train(lsq_loss, rule(), W0, {"x": SlowColumn(DATA["x"]), "y": DATA["y"]}, config)
    lines = [json.loads(x) for x in pathlib.Path(result.trace_path).read_text().splitlines()]
    assert result.pushes_applied == 20 and [x["round"] for x in lines] == [[1]] * 20
    assert result.workers[0].stopped >= 1
    np.testing.assert_allclose(replay_clean(tmp_path, rule(), seed=3).params, result.params, rtol=1e-6, atol=1e-7)


def test_sync_mode_on_ray_is_the_simulators_ssgd(local_ray):
    seed = 3
    key = jax.random.key(seed)
    result = train(
        lsq_loss,
        rule(),
        W0,
        DATA,
        TrainConfig(Plan(2, num_updates=12, batch_size=4, mode="sync"), seed=seed, backend="ray"),
    )
    assert result.pushes_applied == 12 and set(result.staleness_counts) == {0}
    assert [w.pushes for w in result.workers] == [12, 12]
    sim = simulate_clean(rule(), asgd_jax.delays.Workers(2), 12, key=key, mode="sync")
    np.testing.assert_allclose(sim.params, result.params, rtol=1e-5, atol=1e-6)


def test_in_sync_mode_a_restarted_worker_rejoins_its_round_and_the_result_is_still_ssgd(local_ray, tmp_path):
    seed = 3
    key = jax.random.key(seed)
    thread, box = _train_in_thread(num_updates=300, out=str(tmp_path), max_restarts=1, mode="sync")
    killed_at = _kill_when(tmp_path / "trace.jsonl", 20, "worker-1", box, pusher=0)
    assert killed_at < 250, "the kill came too late to test anything: make the run longer"
    result = _result(thread, box)
    assert list(result.failures) == [1] and result.pushes_applied == 300
    sim = simulate_clean(rule(), asgd_jax.delays.Workers(2), 300, key=key, mode="sync")
    np.testing.assert_allclose(sim.params, result.params, rtol=1e-4, atol=1e-5)


def test_a_killed_worker_actor_is_restarted_and_the_run_goes_on(local_ray, tmp_path):
    thread, box = _train_in_thread(num_updates=600, out=str(tmp_path), max_restarts=1)
    killed_at = _kill_when(tmp_path / "trace.jsonl", 20, "worker-1", box)
    assert killed_at < 500, "the kill came too late to test anything: make the run longer"
    result = _result(thread, box)
    assert list(result.failures) == [1]  # reported
    assert result.pushes_applied == 600 and result.pushes_sent == result.pushes_applied + result.pushes_rejected
    np.testing.assert_allclose(replay(result.trace_path, 600), result.params, rtol=1e-4, atol=1e-5)


def test_a_killed_worker_actor_without_restarts_is_dropped_and_the_others_finish_the_run(local_ray, tmp_path):
    thread, box = _train_in_thread(num_updates=600, out=str(tmp_path))  # max_restarts=0: the default
    killed_at = _kill_when(tmp_path / "trace.jsonl", 20, "worker-1", box)
    assert killed_at < 500, "the kill came too late to test anything: make the run longer"
    result = _result(thread, box)
    assert list(result.failures) == [1] and result.failures[1].startswith("ActorDiedError: "), result.failures
    assert "/worker-1" in result.failures[1]  # Ray's message names the actor
    assert result.pushes_applied == 600
    trace = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    last_of_1 = max(i for i, r in enumerate(trace) if r["worker"] == 1)
    # Worker 1 stopped pushing at the kill (Ray kills asynchronously: allow for pushes on their way), and worker 0 alone
    # made the rest of the 600 updates.
    assert last_of_1 < killed_at + 50 and len(trace) - (last_of_1 + 1) >= 600 - (killed_at + 50)
    np.testing.assert_allclose(replay(result.trace_path, 600), result.params, rtol=1e-4, atol=1e-5)


def test_with_on_worker_failure_stop_a_killed_worker_actor_stops_the_run_cleanly(local_ray, tmp_path):
    thread, box = _train_in_thread(num_updates=600, out=str(tmp_path), on_worker_failure="stop")
    killed_at = _kill_when(tmp_path / "trace.jsonl", 20, "worker-1", box)
    assert killed_at < 500, "the kill came too late to test anything: make the run longer"
    result = _result(thread, box)
    assert list(result.failures) == [1] and result.pushes_applied < 600
    assert result.pushes_sent == result.pushes_applied + result.pushes_rejected
    # Stopped cleanly: the final checkpoint holds every applied update, and the trace replays to the weights.
    with np.load(tmp_path / "checkpoint.npz") as f:
        assert json.loads(bytes(f["__header__"]).decode())["applied"] == result.pushes_applied
    np.testing.assert_allclose(replay(result.trace_path, result.pushes_applied), result.params, rtol=1e-4, atol=1e-5)


def test_a_killed_store_actor_resumes_from_its_checkpoint_with_the_adamw_inner_states_and_the_run_replays(
    local_ray, tmp_path
):
    # Killed, the store actor comes back from its last checkpoint (one every 10 updates) and the run goes on to its
    # budget. Each worker actor pushes its AdamW state with its delta; the store actor keeps and checkpoints it, and
    # every worker re-syncs to the state it had there: the whole trace replays in the simulator, whose workers never
    # lost theirs. (A plain rule's store comes back too: the million-weights test below, without a replay.)
    sync = dict(n_sync=3, push="delta", local_lr=0.02, inner="adamw")
    diloco = asgd_jax.rules.diloco(0.5)
    thread, box = _train_in_thread(the_rule=diloco, num_updates=90, out=str(tmp_path), checkpoint_every=10, **sync)
    _kill_when(tmp_path / "trace.jsonl", 30, "store", box)
    result = _result(thread, box)
    assert result.resumed_from > 0 and result.resumed_from % 10 == 0
    assert result.pushes_applied == 90 and not result.failures
    trace = asgd_jax.delays.Trace.load(result.trace_path, num=2)
    replayed = simulate_clean(diloco, trace, 90, key=3, **sync)
    np.testing.assert_allclose(replayed.params, result.params, rtol=1e-5, atol=1e-6)


def test_a_killed_store_actor_with_a_million_weights_comes_back_from_its_checkpoint(local_ray, tmp_path):
    """Ray restarts the store actor by calling its constructor again: its arguments (4 MB of weights, not inlined into
    the call) must still be in the object store then. They were freed, and the run made no progress, saying nothing."""
    # (4 MB a push through Ray's object store: 200 updates, the kill at 50, leave it ~15 s to land on 2 cores)
    thread, box = _train_in_thread(big_loss, BIG, num_updates=200, out=str(tmp_path), checkpoint_every=10)
    _kill_when(tmp_path / "trace.jsonl", 50, "store", box)
    result = _result(thread, box)
    assert result.resumed_from > 0 and result.resumed_from % 10 == 0
    assert result.pushes_applied == 200 and not result.failures
    assert result.params["big"].shape == (1_000_000,)


def test_ctrl_c_on_ray_writes_a_final_checkpoint_and_resume_finishes_the_run(local_ray, tmp_path, monkeypatch):
    # Ctrl-C raises KeyboardInterrupt in the driver, which sits in ray.wait: simulated there once 50 updates are in.
    original_wait = ray.wait

    def wait(*args, **kwargs):
        trace = tmp_path / "trace.jsonl"
        if trace.exists() and len(trace.read_text().splitlines()) >= 50:
            raise KeyboardInterrupt
        return original_wait(*args, **kwargs)

    monkeypatch.setattr(ray, "wait", wait)
    with pytest.raises(KeyboardInterrupt, match="resume=True continues"):
        train(
            lsq_loss,
            rule(),
            W0,
            DATA,
            TrainConfig(Plan(2, num_updates=300, batch_size=4), seed=3, backend="ray", out=str(tmp_path)),
        )
    with np.load(tmp_path / "checkpoint.npz") as f:
        stopped_at = json.loads(bytes(f["__header__"]).decode())["applied"]
    assert 50 <= stopped_at < 300  # the final checkpoint holds every applied update (no checkpoint_every was set)
    assert len((tmp_path / "trace.jsonl").read_text().splitlines()) == stopped_at
    monkeypatch.setattr(ray, "wait", original_wait)
    result = train(
        lsq_loss,
        rule(),
        W0,
        DATA,
        TrainConfig(Plan(2, num_updates=300, batch_size=4), seed=3, backend="ray", out=str(tmp_path), resume=True),
    )
    assert result.resumed_from == stopped_at and result.pushes_applied == 300
    np.testing.assert_allclose(replay(result.trace_path, 300), result.params, rtol=1e-4, atol=1e-5)


def test_more_workers_than_the_cluster_has_cpus_for_fail_at_once_naming_the_fix(local_ray):
    """Three one-CPU worker actors on a two-CPU cluster: the third could never be scheduled; nothing is started."""
    before = set(ray.util.list_named_actors())
    config = TrainConfig(Plan(3, batch_size=4, num_updates=50), seed=3, backend="ray")
    with pytest.raises(asgd_jax.errors.ConfigError, match=r"--workers 3 needs 3 CPUs .* has 2: use --workers 2 or"):
        train(lsq_loss, rule(), W0, DATA, config)
    assert set(ray.util.list_named_actors()) <= before


def test_without_ray_the_backend_fails_at_once_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r"pip install 'asgd_jax\[ray\]'"):
        train(lsq_loss, rule(), W0, DATA, TrainConfig(Plan(2, num_updates=5), backend="ray"))


def test_cli_train_on_ray(local_ray, tmp_path, capsys):
    from asgd_jax.cli import main

    argv = [
        "train",
        "--backend",
        "ray",
        "--dataset",
        "digits",
        "--model",
        "mlp",
        "--workers",
        "2",
        "--steps",
        "20",
        "--batch-size",
        "8",
        "--lr",
        "0.1",
        "--schedule",
        "constant",
        "--no-progress",
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 0
    assert "applied 20" in capsys.readouterr().out
    assert len((tmp_path / "trace.jsonl").read_text().splitlines()) == 20
    assert (tmp_path / "model.npz").exists() and (tmp_path / "summary.json").exists()


def test_both_backends_tell_a_slow_data_loader_alike(local_ray, tmp_path):
    """One worker loop: summary.json's figures mean the same on threads and on Ray. Every minibatch read takes 50 ms
    (injected into the data): that is data wait on both, and the overhead outside compute says so on both.

    Without a bound on how long anything else takes (a loaded machine slows compute and exchange, and then the
    prefetch thread keeps minibatches ready): a worker's loader, at most ``prefetch + 1`` minibatches ahead when the
    loop starts, makes one per 50 ms after that, so a worker that used N minibatches spent at least
    (N - prefetch - 1) x 50 ms in its loop, and what of it compute and exchange do not explain is data wait."""
    data = {"x": SlowColumn(DATA["x"]), "y": DATA["y"]}
    # (prefetch counts blocks of minibatches; a column that reads itself on each access, as SlowColumn does, comes a
    # minibatch a block)
    ahead = inspect.signature(ShardLoader).parameters["prefetch"].default + 1
    summaries = {}
    for backend in ("threads", "ray"):
        config = train_config(2, num_updates=24, batch_size=4, seed=3, backend=backend, out=str(tmp_path / backend))
        train(lsq_loss, rule(), W0, data, config.replace(progress=False, timeout=LIMIT))
        summaries[backend] = json.loads((tmp_path / backend / "summary.json").read_text())
    for backend, summary in summaries.items():
        workers = summary["workers"]
        assert sum(w["pushes"] for w in workers) == summary["pushes_sent"], backend
        for w in workers:
            assert w["total"] == pytest.approx(w["data"] + w["compute"] + w["exchange"]), backend
        for w, overhead in zip(workers, summary["worker_overhead"], strict=True):
            unexplained = (w["pushes"] - ahead) * SlowColumn.DELAY - w["compute"] - w["exchange"]
            assert w["data"] >= unexplained - SlowColumn.DELAY, (backend, w)  # a delay's slack: untimed bookkeeping
            assert overhead * w["total"] == pytest.approx(w["data"] + w["exchange"]), (backend, w)
