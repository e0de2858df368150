"""The host-side parameter store: bad pushes never touch the model, the exchange updates in place, SSGD rounds."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from concurrent.futures import Future

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import asgd_jax
from asgd_jax import packing
from asgd_jax.trainer.store import BadPush, ParameterStore, StaleRound, StoreClosed


def test_store_rejects_bad_pushes_and_keeps_the_model():
    store = ParameterStore(asgd_jax.asgd(0.1), {"w": np.zeros(3, np.float32)}, 2, num_updates=5)
    try:
        params, _, version = store.pull(0)
        with pytest.raises(BadPush, match="tree structure"):
            store.push(0, {"v": np.ones(3, np.float32)}, version)
        with pytest.raises(BadPush, match=r"leaf 0 is float32\[4\]"):
            store.push(0, {"w": np.ones(4, np.float32)}, version)
        with pytest.raises(BadPush, match="float64"):
            store.push(0, {"w": np.ones(3, np.float64)}, version)
        with pytest.raises(BadPush, match="NaN or Inf"):
            store.push(1, {"w": np.array([1.0, np.nan, 0.0], np.float32)}, version).result(timeout=10)
        with pytest.raises(BadPush, match="NaN or Inf"):  # a payload already on a device is checked there
            store.push(1, {"w": jnp.array([0.0, 0.0, jnp.inf])}, version).result(timeout=10)
        np.testing.assert_array_equal(store.state().params["w"], np.zeros(3))  # untouched
        params, _, version = store.push(1, {"w": np.ones(3, np.float32)}, version).result(timeout=10)
        np.testing.assert_allclose(params["w"], -0.1 * np.ones(3))
        s = store.status()
        assert (s.received, s.applied, s.rejected, s.late) == (6, 1, 5, 0)
        with pytest.raises(ValueError, match="worker=2"):
            store.pull(2)
        # DC-ASGD's backups are the pulled weights: worker 1 pulled (by pushing) the current ones, worker 0 still
        # holds what it pulled at version 0.
        for worker, expected, at in ((0, np.zeros(3), 0), (1, -0.1 * np.ones(3), 1)):
            backup, _, backup_version = store.backup(worker)
            np.testing.assert_array_equal(backup["w"], expected.astype(np.float32))
            assert backup_version == at
    finally:
        store.close()


@pytest.mark.parametrize(
    ("rule", "stacks"),
    [
        (asgd_jax.dc_asgd(0.05, 2.0, adaptive=True, num_workers=4), ["f32[4,2048]", "f32[4,2048]"]),
        (asgd_jax.rules.get("ia2sgd", 0.05, num_workers=4), ["f32[4,2048]", "f32[4,64,32]"]),
    ],
    ids=["dc_asgd_a_packed", "ia2sgd_pytree"],
)
def test_the_exchange_updates_the_per_worker_stacks_in_place(rule, stacks):
    # Two M x params stacks each: the backups and the rule's per-worker table (DC-ASGD-a's MeanSquare per worker;
    # IA2SGD's latest gradients). The store's exchange must update one slot of each in place: a copy of a stack per
    # push cost 2 x 16 MB at 1.1M parameters. DC-ASGD is elementwise: its table is kept for the weights packed
    # (asgd_jax.trainer.state.StateLayout); IA2SGD's keeps the weights' shape (the pytree: a mean over the workers).
    store = ParameterStore(rule, {"w": np.zeros((64, 32), np.float32)}, 4)
    try:
        payload = jax.device_put({"w": np.ones((64, 32), np.float32)}, store.device)
        hlo = store.lower_exchange(1, payload).compile().as_text()
    finally:
        store.close()
    # Both stacks are the program's arguments (the backups packed: one [4, 2048] row per worker), neither copied.
    entry = next(line for line in hlo.splitlines() if line.startswith("ENTRY")).split("->")[0]
    assert sorted(t for t in ("f32[4,2048]", "f32[4,64,32]") for _ in range(entry.count(t))) == sorted(stacks), entry
    stack_copies = [line for line in hlo.splitlines() if "f32[4," in line and " copy(" in line]
    assert not stack_copies, stack_copies


@pytest.mark.parametrize("name", ["dana", "ia2sgd"])
def test_a_bfloat16_models_per_worker_tables_are_updated_in_place_too(name):
    # A table's row written with .at[slot].set was a scatter whose bounds check XLA:CPU ran in float32 for a bfloat16
    # table: the whole table converted there and back, a copy per push (DANA's velocities stepped packed, IA2SGD's
    # gradients as a pytree; asgd_jax.server.replace_row).
    params = {"a": jnp.ones((7, 5), jnp.bfloat16), "b": jnp.ones(3, jnp.float32)}
    store = ParameterStore(asgd_jax.rules.get(name, 0.1, num_workers=4), params, 4)
    try:
        hlo = store.lower_exchange(1, jax.tree.map(jnp.ones_like, params)).compile().as_text()
    finally:
        store.close()
    assert "bf16[4," in hlo
    assert not [line for line in hlo.splitlines() if "[4," in line and " copy(" in line]


def test_the_exchange_writes_the_weights_and_moments_in_place_and_computes_the_update_once():
    # DC-ASGD-a with one MeanSquare: the weights and the moment are written where they are read (packed together,
    # their concatenation went to a new buffer copied back each push), and the compensation is computed once (in
    # one loop with the backup row's write, XLA fused the whole update a second time into that write).
    store = ParameterStore(asgd_jax.dc_asgd(0.05, 2.0, adaptive=True), {"w": np.zeros(4096, np.float32)}, 4)
    try:
        hlo = store.lower_exchange(1, {"w": np.ones(4096, np.float32)}).compile().as_text()
    finally:
        store.close()
    copies = [line for line in hlo.splitlines() if " copy(" in line and "f32[" in line]
    assert not copies, copies
    adaptive = [line for line in hlo.splitlines() if " rsqrt(" in line]
    assert len(adaptive) == 1, adaptive  # lambda_0 / sqrt(MeanSquare + eps), in the one fusion of the update


def _kernels(rule, params) -> int:
    store = ParameterStore(rule, params, 4)
    try:
        hlo = store.lower_exchange(1, jax.tree.map(np.ones_like, params)).compile().as_text()
    finally:
        store.close()
    return sum(" fusion(" in line for line in hlo.splitlines())


@pytest.mark.parametrize("rule", ["asgd", "dc_asgd_a"])
def test_an_elementwise_rules_exchange_runs_as_many_kernels_for_twenty_leaves_as_for_one(rule):
    """The store applies an elementwise rule to the weights packed (``StateLayout``'s working form): its exchange's
    kernels do not grow with the leaf count (leaf by leaf, ResNet-20's 59 leaves made 130 kernels for ASGD, 308 for
    DC-ASGD-a; the same weights in one leaf, 14 and 17). A rule that is not elementwise keeps the pytree."""
    leaves = {f"w{i:02d}": np.full((i + 1, 3), 0.1, np.float32) for i in range(20)}
    one = {"w": np.full(sum(x.size for x in leaves.values()), 0.1, np.float32)}
    assert _kernels(asgd_jax.rules.get(rule, 0.1), leaves) == _kernels(asgd_jax.rules.get(rule, 0.1), one)
    if rule == "asgd":
        gap_aware = asgd_jax.rules.get("gap_aware", 0.1)
        assert _kernels(gap_aware, leaves) > 2 * _kernels(gap_aware, one)


def test_store_stop_policy_and_budget():
    store = ParameterStore(asgd_jax.asgd(0.1), np.zeros(2, np.float32), 1, on_nonfinite="stop")
    with pytest.raises(BadPush):
        store.push(0, np.array([np.inf, 0.0], np.float32), 0).result(timeout=10)
    with pytest.raises(StoreClosed, match="NaN or Inf"):
        store.push(0, np.ones(2, np.float32), 0)
    store.close()
    budget = ParameterStore(asgd_jax.asgd(0.1), np.zeros(2, np.float32), 1, num_updates=1)
    budget.push(0, np.ones(2, np.float32), 0).result(timeout=10)
    with pytest.raises(StoreClosed, match="after 1 updates"):
        budget.push(0, np.ones(2, np.float32), 1)
    budget.close()


def _round(store, payloads, version=0):
    """Every worker's push_round from a thread of its own; their answers (or exceptions) by worker."""
    answers: dict[int, object] = {}

    def send(w):
        try:
            answers[w] = store.push_round(w, payloads[w], version, timeout=60)
        except Exception as e:
            answers[w] = e

    threads = [threading.Thread(target=send, args=(w,)) for w in range(len(payloads))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return answers


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])  # (bfloat16: the mean was worker 0's payload)
def test_an_ssgd_round_applies_the_mean_of_all_workers_once(dtype):
    store = ParameterStore(asgd_jax.asgd(0.5), {"w": np.zeros(2, dtype)}, 3)
    try:
        payloads = [{"w": np.array([1.0, 0.0], dtype) * np.asarray(w + 1, dtype)} for w in range(3)]  # mean: [2, 0]
        answers = _round(store, payloads)
        assert store.status().applied == 1 and store.status().received == 1  # one update, pushed as worker 0
        for w in range(3):
            params, _, version = answers[w]
            assert params["w"].dtype == np.dtype(dtype) and params["w"].tolist() == [-1.0, 0.0]  # w - 0.5 * mean
            assert version == 1
        with pytest.raises(StaleRound, match="computed at version 0, the store is at 1"):
            store.push_round(1, payloads[1], 0)
        # A non-finite mean is rejected: every worker gets the unchanged weights back, and the next round goes on.
        bad = [{"w": np.array([np.nan, 0.0], dtype)}, *payloads[1:]]
        answers = _round(store, bad, version=1)
        assert store.status().applied == 1 and store.status().rejected == 1
        assert all(answers[w][0]["w"].tolist() == [-1.0, 0.0] and answers[w][2] == 1 for w in range(3))
    finally:
        store.close()


def _ordered(x: np.ndarray) -> np.ndarray:
    """Floats as integers in their order: neighbouring floats (a last bit apart, -0 and +0 alike) differ by 1."""
    bits = x.view(np.int16 if x.itemsize == 2 else np.int32).astype(np.int64)
    return np.where(bits < 0, -(2 ** (8 * x.itemsize - 1)) - bits, bits)


@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from([np.float32, np.float16, jnp.bfloat16]), st.integers(1, 16), st.integers(0, 40), st.integers(0, 99)
)
def test_a_rounds_mean_on_the_host_is_numpys_in_float32_and_a_last_bit_from_the_simulators(dtype, m, n, seed):
    rng = np.random.default_rng(seed)
    trees = [{"g": (rng.normal(size=n) * 10).astype(dtype), "step": np.int32(w + 3)} for w in range(m)]
    mean = asgd_jax.exchange.host_mean(trees)
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *trees)
    wide = np.float32 if np.dtype(dtype).itemsize == 2 else None  # (a 16-bit float summed in float32, as jnp.mean)
    formula = np.mean(stacked["g"], axis=0, dtype=wide).astype(dtype)
    assert mean["g"].dtype == np.dtype(dtype) and mean["g"].tobytes() == formula.tobytes()
    # The simulator's (XLA adds the rows in an order of its own and multiplies by 1 / M): at most a last bit apart.
    simulator = np.asarray(jax.jit(asgd_jax.exchange.mean_tree)(stacked)["g"])
    assert np.all(np.abs(_ordered(mean["g"]) - _ordered(simulator)) <= 1)
    assert mean["step"] == 3  # an integer: the first worker's
    assert n == 0 or mean["g"].ctypes.data % packing.ALIGNMENT == 0  # (a CPU store takes it without a copy)


def test_calling_the_rounds_off_releases_every_waiting_worker():
    store = ParameterStore(asgd_jax.asgd(0.5), {"w": np.zeros(2, np.float32)}, 3)
    try:
        result: dict[str, BaseException] = {}

        def wait():
            try:
                store.push_round(0, {"w": np.ones(2, np.float32)}, 0, timeout=60)
            except StoreClosed as e:
                result["error"] = e

        thread = threading.Thread(target=wait)
        thread.start()
        store.abort_rounds("worker 2 failed")  # a worker died: SSGD cannot go on
        thread.join(timeout=60)
        assert not thread.is_alive() and "worker 2 failed" in str(result["error"])
        with pytest.raises(StoreClosed):
            store.push_round(1, {"w": np.ones(2, np.float32)}, 0)
    finally:
        store.close()


def test_the_store_keeps_its_state_on_the_device_it_is_given_and_takes_pushes_from_other_devices():
    """``store_device``: the server state lives there, and a payload lying on a worker's device is applied exactly as
    the same payload from the host."""
    from asgd_jax.trainer import TrainConfig
    from asgd_jax.trainer.endpoint import for_run

    params = {"w": np.arange(3, dtype=np.float32)}
    config = TrainConfig(asgd_jax.Plan(2, num_updates=10), store_device="cpu:3", progress=False)
    on_device, on_host = (
        for_run(asgd_jax.dc_asgd(0.5, 2.0, adaptive=True), params, config, header={}, model_state=None, evaluates=False)
        for _ in range(2)
    )
    try:
        assert on_device.device == jax.devices("cpu")[3]
        assert {d for x in jax.tree.leaves(on_device.server.state) for d in x.devices()} == {jax.devices("cpu")[3]}
        grads = np.array([0.5, -1.0, 2.0], np.float32)
        for store, payload in ((on_device, jax.device_put(grads, jax.devices("cpu")[1])), (on_host, grads)):
            store.pull(1)
            store.push(0, (payload,), 0, packed=True).result(timeout=60)
            store.push(1, (payload,), 0, packed=True).result(timeout=60)  # stale by one: the correction is used
        np.testing.assert_array_equal(on_device.final_weights()[0]["w"], on_host.final_weights()[0]["w"])
    finally:
        on_device.close()
        on_host.close()


@pytest.mark.parametrize(
    ("spec", "says"),
    [("GPU 1", "PLATFORM"), ("cpu:", "PLATFORM"), ("tpu", "no tpu device"), ("cpu:99", "index below 8")],
)
def test_a_store_device_that_is_not_there_is_refused_by_name(spec, says):
    from asgd_jax.trainer import TrainConfig

    with pytest.raises(asgd_jax.ConfigError, match=f"store_device.*{spec!r}.*{says}|{says}"):
        TrainConfig(store_device=spec).store_device_now()


def test_a_push_that_reaches_the_applier_after_the_store_closed_is_answered_and_counted():
    """The race of a push that passed the closed check just before close(): it once reached a queue nobody read, its
    future never resolved and it was counted as received only (sent 9 = applied 8 + rejected 0). Injected here by
    handing it to the applier after close."""
    store = ParameterStore(asgd_jax.asgd(0.5), {"w": np.zeros(3, np.float32)}, 2)
    store.push(0, {"w": np.ones(3, np.float32)}, 0).result(timeout=60)
    store.close()
    future = Future()
    payload = store.server.put(store.server.packed_payload(1, {"w": np.ones(3, np.float32)}, None))
    with store.lock:
        store.ledger.received += 1  # what push() counted before the gate
    store.applier.put((1, *payload, 0, None, False, future))
    with pytest.raises(StoreClosed):
        future.result(timeout=60)
    s = store.status()
    assert s.received == s.applied + s.rejected and (s.applied, s.late) == (1, 1)


def _pushes(pipelined: bool, payloads: list, folder=None, rule_name="dc_asgd_a", **store_kwargs) -> tuple:
    """Pushes ``payloads`` (worker, gradient) through a store (DC-ASGD-a by default), pipelined or not; what comes
    back: the answers, the status, the final weights, the snapshots and checkpoints taken (version, weights) and the
    final checkpoint's books."""
    rule = asgd_jax.rules.get(rule_name, 0.1, **({"num_workers": 2} if rule_name == "dana" else {}))
    w0 = {"w": np.linspace(-1, 1, 6, dtype=np.float32)}
    store = ParameterStore(rule, w0, 2, pipelined=pipelined, out_dir=folder, checkpoint_dir=folder, **store_kwargs)
    taken = []
    if folder is not None:  # every checkpoint handed to the writer (a newer one supersedes one not written yet)
        submit = store.checkpoints.submit
        store.checkpoints.submit = lambda c: (taken.append((int(c[0].version), np.array(c[0].params["w"]))), submit(c))
    answers = []
    try:
        versions = [store.pull(w)[2] for w in (0, 1)]
        for worker, g in payloads:
            try:
                future = store.push(worker, jax.device_put({"w": g}, store.device), versions[worker])
                params, _, versions[worker] = future.result(timeout=30)
                answers.append(np.array(params["w"]))
            except (BadPush, StoreClosed):
                answers.append(np.array(store.backup(worker)[0]["w"]))  # where the worker goes on
                versions[worker] = store.backup(worker)[2]
    finally:
        store.close()
    snapshots = [(s.version, np.asarray(s.params["w"])) for s in store.take_snapshots()] + taken
    books = None
    if folder is not None:
        state, arrays, _ = asgd_jax.checkpoint.load(os.path.join(folder, "checkpoint.npz"), store.state())
        books = (
            np.asarray(state.params["w"]),
            int(state.version),
            {k: np.asarray(v).tolist() for k, v in arrays.items()},
        )
        with open(os.path.join(folder, "trace.jsonl")) as f:  # (each line without its wall-clock time)
            books += ([{k: v for k, v in json.loads(line).items() if k != "time"} for line in f],)
    return answers, store.status(), np.asarray(store.final_weights()[0]["w"]), snapshots, books


_G = lambda s: np.full(6, s, np.float32)
_NAN = np.array([1, np.nan, 0, 0, 0, 0], np.float32)
_PAYLOADS = [(0, _G(0.5)), (1, _G(-0.25)), (1, _NAN), (0, _G(1.0)), (1, _G(0.125)), (0, _NAN), (1, _G(2.0))]


def test_a_pipelined_store_answers_and_books_exactly_as_an_unpipelined_one():
    # Pipelined, a push is answered before the host reads its flags: a NaN push is answered with its worker's
    # backup (where it goes on) and booked as rejected when the next push arrives (after that one is dispatched:
    # two in flight), or when the store closes.
    plain, plain_status, plain_final, _, _ = _pushes(False, _PAYLOADS)
    piped, piped_status, piped_final, _, _ = _pushes(True, _PAYLOADS)
    for a, b in zip(plain, piped, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(plain_final, piped_final)
    assert (piped_status.applied, piped_status.rejected, piped_status.received) == (5, 2, 7)
    assert piped_status._replace(times=None) == plain_status._replace(times=None)


@pytest.mark.parametrize("rule_name", ["dc_asgd_a", "dana"])  # (DANA's snapshots read the state: it sends a look-ahead)
@pytest.mark.parametrize("every", [1, 2, 3])
@pytest.mark.parametrize("taking", ["checkpoint_every", "snapshot_every"])
def test_a_pipelined_store_checkpoints_snapshots_and_ends_at_the_same_updates(tmp_path, taking, every, rule_name):
    # Two pushes in flight only where nothing is decided from the books of the first: the budget's last update, a
    # checkpoint and a snapshot are taken with the books exact, at the very updates an unpipelined store takes them.
    kwargs = {"num_updates": 4, taking: every, "rule_name": rule_name}
    finite = [(w, _G(0.3 * i - 0.5)) for i, (w, _) in enumerate(_PAYLOADS)]
    plain = _pushes(False, finite, str(tmp_path / "plain"), **kwargs)
    piped = _pushes(True, finite, str(tmp_path / "piped"), **kwargs)
    for a, b in zip(plain[0], piped[0], strict=True):
        np.testing.assert_array_equal(a, b)
    assert piped[1]._replace(times=None) == plain[1]._replace(times=None)
    assert (piped[1].applied, piped[1].late) == (4, 3)
    assert [v for v, _ in piped[3]] == [v for v, _ in plain[3]] == list(range(every, 5, every))
    for (_, a), (_, b) in zip(plain[3], piped[3], strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(plain[4][0], piped[4][0])
    assert plain[4][1:] == piped[4][1:]


@pytest.mark.parametrize("rule_name", ["asgd", "dc_asgd_a", "dana"])
def test_the_stored_state_is_a_few_buffers_and_steps_as_the_server_does(rule_name):
    # 30 leaves in two dtypes: the store keeps them as a handful of buffers (what one push dispatches), and its
    # pushes leave the state that asgd_jax.server.exchange leaves on the pytree: the same arithmetic, to the ulp
    # (XLA:CPU contracts a multiply-add into one rounding or not depending on where an element falls in a vector
    # loop, which packing moves: the trainer's replays are close, not bit for bit, for the same reason).
    from asgd_jax import server

    rng = np.random.default_rng(0)
    dtypes = (np.float32, jnp.bfloat16)
    params = {f"l{i}": rng.normal(size=(i % 5 + 1, 3)).astype(dtypes[i % 2]) for i in range(30)}
    rule = asgd_jax.rules.get(rule_name, 0.1, **({"num_workers": 3} if rule_name == "dana" else {}))
    store = ParameterStore(rule, params, 3)
    reference = jax.jit(lambda p: server.init(rule, p, 3))(params)
    step = jax.jit(lambda s, w, g: server.exchange(rule, s, w, g)[0])
    try:
        # A buffer per dtype for each role of the live state (weights, rule state, model state) and for the backups,
        # the versions; DANA's 30 per-worker momentum tables stay leaves of their own (a push writes one row of
        # each, in place).
        tables = 30 if rule_name == "dana" else 0
        assert len(jax.tree.leaves(store.server.stored)) <= 4 * len(dtypes) + 2 + tables
        for t, worker in enumerate((0, 2, 2, 1, 0)):
            g = jax.tree.map(lambda p, t=t: (rng.normal(size=p.shape) * (t + 1)).astype(p.dtype), params)
            store.push(worker, g, 0).result(timeout=30)
            reference = step(reference, np.int32(worker), g)
        for a, b in zip(jax.tree.leaves(store.state()), jax.tree.leaves(reference), strict=True):
            eps = float(jnp.finfo(b.dtype).eps) if jnp.issubdtype(b.dtype, jnp.floating) else 0.0
            # (one rounding per multiply-add and step: 16 units in the last place of the value, at least of 1; the
            # gradients grow with t, so the weights reach ~4, where an absolute 16 eps is only ~4 ulps; on an AMD EPYC
            # with AVX-512, DC-ASGD-a's store and pytree programs differ there by 12 ulps.)
            ulps = 16 * eps * np.maximum(1.0, np.abs(np.asarray(b, np.float32)))
            np.testing.assert_array_less(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)), ulps + 1e-30)
    finally:
        store.close()


@pytest.mark.parametrize("name", ["asgd", "dc_asgd_a", "dana", "gap_aware"])
def test_a_non_finite_push_leaves_the_whole_state_as_it_was(name):
    """Weights, the rule's state (counters, moments, tables), every backup and version: bit for bit, whichever way the
    exchange runs (ASGD: its push selected; DC-ASGD-a: stepped packed, in a loop; DANA: a pull rule with per-worker
    tables; Gap-Aware: the pytree, a moment)."""
    params = {"a": np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3), "b": np.full(5, 0.5, np.float32)}
    store = ParameterStore(asgd_jax.rules.get(name, 0.1, **{k: 3 for k in asgd_jax.rules.required(name)}), params, 3)
    try:
        for worker in range(3):  # (a state that moved: counters, moments and backups not at their initial values)
            store.push(worker, jax.tree.map(lambda x, w=worker: np.full_like(x, 0.1 * (w + 1)), params), 0).result(10)
        before = jax.device_get(store.state())
        bad = {"a": np.ones((2, 3), np.float32), "b": np.array([0, 0, np.inf, 0, 0], np.float32)}
        with pytest.raises(BadPush, match="NaN or Inf"):
            store.push(1, bad, 3).result(timeout=10)
        after = jax.device_get(store.state())
        assert jax.tree.structure(after) == jax.tree.structure(before)
        assert all(jax.tree.leaves(jax.tree.map(np.array_equal, after, before)))
    finally:
        store.close()


def test_a_workers_payload_comes_with_its_own_check_and_the_store_reads_no_pass_of_it():
    # A worker's period checks its payload in its own program (Checked); the store trusts the flag, and its exchange
    # for such pushes reads the payload once, for the update (one reduction fewer: the answer's own check is left).
    from asgd_jax.trainer.messages import Checked

    store = ParameterStore(asgd_jax.asgd(0.1), {"w": np.zeros(3, np.float32)}, 2, num_updates=5)
    try:
        _, _, version = store.pull(0)
        ones = (np.ones(3, np.float32),)
        with pytest.raises(BadPush, match="NaN or Inf"):  # the flag decides: a payload its worker found non-finite
            store.push(0, Checked(ones, np.bool_(False)), version, packed=True).result(timeout=10)
        with pytest.raises(BadPush, match="NaN or Inf"):  # a plain payload is checked by the store itself
            store.push(0, (np.array([0.0, np.nan, 0.0], np.float32),), version, packed=True).result(timeout=10)
        np.testing.assert_array_equal(store.state().params["w"], np.zeros(3))  # untouched by either
        params, _, _ = store.push(0, Checked(ones, np.bool_(True)), version, packed=True).result(timeout=10)
        np.testing.assert_allclose(params[0], -0.1 * np.ones(3))
        s = store.status()
        assert (s.applied, s.rejected) == (1, 2)
        hlo = lambda payload: store.server.lower(0, payload, ()).compile().as_text()
        reductions = lambda payload: hlo(payload).count(" reduce(")
        assert reductions(Checked(ones, np.bool_(True))) == reductions(ones) - 1 >= 1
    finally:
        store.close()


@pytest.mark.parametrize("pipelined", [False, True])
def test_an_exchange_that_fails_on_the_device_ends_the_store_with_the_last_weights_it_answered(pipelined):
    # A failing exchange consumes the donated state: its buffers are deleted, or, dispatched ahead (pipelined), they
    # hold the exchange's error. Either way the store stops with the applier's error, and its final weights are those
    # of the last push it answered (what a run returns), never the error (which once came out of a run's close).
    fail = threading.Event()

    def check(x):
        if fail.is_set():
            raise RuntimeError("injected fault on the device")
        return x

    base = asgd_jax.asgd(0.1)

    def update(g, state, params=None, **extra):
        return base.update(jax.tree.map(lambda x: jax.pure_callback(check, x, x), g), state, params, **extra)

    store = ParameterStore(
        optax.GradientTransformationExtraArgs(base.init, update), {"w": _G(0.0)}, 2, pipelined=pipelined
    )
    payload = lambda s: jax.device_put((_G(s),), store.device)  # (packed: one buffer, a worker's push)
    try:
        version = store.pull(0)[2]
        *answered, version = store.push(0, payload(0.5), version, packed=True).result(timeout=30)
        fail.set()
        with contextlib.suppress(StoreClosed):  # (pipelined: answered at once, before the device ran it)
            store.push(0, payload(1.0), version, packed=True).result(timeout=30)
    finally:
        store.close()
    status = store.status()
    assert store.server.lost() and "injected fault on the device" in str(status.error)
    assert (status.received, status.applied, status.rejected) == (2, 1, 1)
    np.testing.assert_array_equal(store.final_weights()[0]["w"], np.asarray(answered[0][0]))
    np.testing.assert_array_equal(store.final_weights()[0]["w"], _G(-0.05))


@pytest.mark.parametrize("rule_name", ["asgd", "dc_asgd_a", "dana"])
def test_a_stores_programs_take_the_rules_numbers_as_arguments(rule_name):
    # Numbers are arguments: stores of one rule at two learning rates lower the same exchange (their numbers once
    # were constants of it: every --lr compiled its own), and each applies its own rate.
    extra = {"num_workers": 2} if rule_name == "dana" else {}
    w0, g = {"w": np.zeros(6, np.float32)}, {"w": np.linspace(-1, 1, 6, dtype=np.float32)}
    texts, weights = [], []
    for lr in (0.1, 0.2):
        store = ParameterStore(asgd_jax.rules.get(rule_name, lr, **extra), w0, 2)
        try:
            texts.append(store.lower_exchange(0, g).as_text())
            store.push(0, g, 0).result(timeout=30)
            weights.append(np.asarray(store.final_weights()[0]["w"]))
        finally:
            store.close()
    assert texts[0] == texts[1]
    if rule_name == "asgd":  # (one SGD step from zero: -lr * g)
        np.testing.assert_allclose(weights, [-0.1 * g["w"], -0.2 * g["w"]], rtol=1e-6)
    assert not np.array_equal(weights[0], weights[1])


def test_a_push_that_fails_after_its_exchange_ran_is_in_the_books_once(monkeypatch):
    # Pipelined, a push is dispatched and booked later; its answer to a caller of pytrees can still fail on the host
    # (injected here). It was counted twice, applied when settled and rejected as the failing push: received 1,
    # applied 1, rejected 1. The store stops, the caller is told, and the books add up.
    from asgd_jax.trainer.applier import Applier

    def fail(self, dispatched):
        raise RuntimeError("injected fault answering on the host")

    monkeypatch.setattr(Applier, "_unpacked", fail)
    store = ParameterStore(asgd_jax.asgd(0.1), {"w": _G(0.0)}, 2, pipelined=True)
    try:
        with pytest.raises(StoreClosed, match="injected fault answering on the host"):
            store.push(0, jax.device_put({"w": _G(1.0)}, store.device), 0).result(timeout=30)
    finally:
        store.close()
    status = store.status()
    assert (status.received, status.applied, status.rejected) == (1, 1, 0)
    np.testing.assert_array_equal(store.final_weights()[0]["w"], _G(-0.1))  # (the exchange ran: its update stands)


def test_a_host_payload_crosses_in_the_exchanges_call_and_is_done_with_when_the_push_returns():
    # The unpipelined store keeps a host payload on the host (no device_put: ~100 us a push) and lets it cross in the
    # exchange's own call, under no implicit transfers elsewhere; the push returns once the exchange has read it, so a
    # caller that reuses its buffer right away changes nothing applied.
    store = ParameterStore(asgd_jax.asgd(0.5), {"w": _G(0.0)}, 2)
    try:
        payload = (_G(1.0),)
        with jax.transfer_guard("disallow"):
            store.push(0, payload, 0, packed=True).result(timeout=30)
        payload[0][:] = 100.0  # (the caller's buffer, reused)
        placed, _ = store.server.placed(0, payload, None, True, in_call=True)
        assert isinstance(placed[0], np.ndarray)  # (kept on the host: it crosses in the call)
    finally:
        store.close()
    np.testing.assert_array_equal(store.final_weights()[0]["w"], _G(-0.5))
