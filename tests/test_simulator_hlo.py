"""What one simulated update costs, read off the compiled program: no parameter-sized copy beyond what the rule needs.

Every count below is over the instructions of the compiled chunk's loop bodies (fusions counted by what they
compute), whose output has the shape of a parameter leaf (a copy, a materialised slice) or of a backup stack (an
update of one slot in place, or a copy of the whole stack). ``copy`` ops are compared with the same count in a plain
``optax.sgd`` ``lax.scan`` (XLA makes the same choice there: on CPU it copies a weight that a dot reads before the
in-place update overwrites it).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.hlo import inventory as _inventory
from helpers.hlo import open_loops_in_update_loop as _open_loops

import asgd_jax
from asgd_jax import delays

WIDTHS = (64, 256, 256, 10)  # the 84k-parameter MLP of the simulator benchmark's workload W
BATCH = 32  # activations [32, 256] never have a weight's shape


def _workload():
    # (NumPy's draws: made at import in both pytest processes, JAX's compiled a sampler per shape, ~5 s of XLA cold)
    rng = np.random.default_rng(0)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))
    params = [draw(a, b) / np.sqrt(a) for a, b in itertools.pairwise(WIDTHS)]
    data = {"x": draw(1024, WIDTHS[0]), "y": jnp.arange(1024) % WIDTHS[-1]}

    def loss(ws, batch):
        h = batch["x"]
        for w in ws[:-1]:
            h = jax.nn.relu(h @ w)
        return optax.softmax_cross_entropy_with_integer_labels(h @ ws[-1], batch["y"]).mean()

    return loss, params, data


LOSS, PARAMS, DATA = _workload()
LEAVES = [tuple(p.shape) for p in PARAMS]


def _floor_hlo(walk_data_order: bool = False) -> str:
    """The compiled chunk of a plain ``optax.sgd`` ``lax.scan``: what a user writes without this project (or, with
    ``walk_data_order``, drawing each minibatch from :mod:`asgd_jax.order` inside the loop)."""
    opt = optax.sgd(0.01)
    words = asgd_jax.order.key_words(jax.random.key(0))

    def chunk(carry, keys):
        def step(c, k):
            params, state = c
            idx = jax.random.randint(k, (BATCH,), 0, 1024)
            if walk_data_order:
                idx = asgd_jax.order.example_index(words, idx[0] % 3, idx, 1024)
            grads = jax.grad(LOSS)(params, jax.tree.map(lambda a: a[idx], DATA))
            updates, state = opt.update(grads, state, params)
            return (optax.apply_updates(params, updates), state), None

        return jax.lax.scan(step, carry, keys)[0]

    carry = (PARAMS, opt.init(PARAMS))
    return jax.jit(chunk, donate_argnums=0).lower(carry, jax.random.split(jax.random.key(0), 10)).compile().as_text()


@pytest.fixture(scope="module")
def floor_copies():
    return _inventory(_floor_hlo(), 1, LEAVES)["param copy"]


CASES = {
    "Workers(8), ASGD": (delays.Workers(8), asgd_jax.asgd(0.01), {}),
    "Workers(8), DC-ASGD-a": (delays.Workers(8), asgd_jax.dc_asgd(0.01, 2.0, adaptive=True), {}),
    "Workers(8), DC-ASGD-a per worker": (
        delays.Workers(8),
        asgd_jax.dc_asgd(0.01, 2.0, adaptive=True, num_workers=8),
        {},
    ),
    "FixedDelay(3), ASGD": (delays.FixedDelay(3), asgd_jax.asgd(0.01), {}),
    "Workers(8), n_sync 4, accumulate": (delays.Workers(8), asgd_jax.asgd(0.01), {"n_sync": 4, "push": "accumulate"}),
    "Workers(8), n_sync 4, local steps": (
        delays.Workers(8),
        asgd_jax.asgd(0.01),
        {"n_sync": 4, "push": "gradients", "local_lr": 0.01},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_update_reads_the_pushing_workers_snapshot_once_and_writes_one_backup_in_place(case, floor_copies):
    model, rule, kwargs = CASES[case]
    plan = asgd_jax.Plan(model, batch_size=BATCH, chunk=10, **kwargs)
    lowered = asgd_jax.simulator.lower(LOSS, rule, PARAMS, DATA, plan)
    counts = _inventory(lowered.compile().as_text(), model.num_slots, LEAVES)
    n = len(LEAVES)
    per_worker = 2 if "per worker" in case else 1  # DC-ASGD-a's per-worker MeanSquare is a stack of its own
    # The snapshot the gradient is computed at: XLA:CPU materialises a dynamic slice that feeds a dot, once per leaf
    # (and the pushing worker's MeanSquare, which the rule reads back after writing it).
    assert counts["param dynamic-slice"] <= per_worker * n, counts
    # The pull: one slot of each backup stack updated in place (the MeanSquare stack likewise)...
    assert counts["stack dynamic-update-slice"] == per_worker * n, counts
    # ...and nothing that produces a whole stack otherwise (a copy, a select, a conditional's result).
    assert sum(v for k, v in counts.items() if k.startswith("stack ")) == per_worker * n, counts
    assert counts["param copy"] <= floor_copies, counts
    assert counts["param select"] == 0, counts


@pytest.mark.parametrize("rule", ["asgd", "dc_asgd_a", "ia2sgd", "dana"])
@pytest.mark.parametrize("loss_form", ["elementwise", "dot-fed"])
def test_a_thousand_workers_write_one_row_per_table_and_copy_no_stack_whatever_the_loss(rule, loss_form):
    # The gradient of 0.5 x.x reads the snapshot elementwise: read as a fused slice, XLA:CPU copied the whole
    # [1000, d] backup stack twice per update to order those reads before the pull's in-place write (#36); IA2SGD's
    # table of latest gradients and DANA's momenta likewise, for either loss.
    d = 64
    x = np.random.default_rng(0).normal(size=(8000, d)).astype(np.float32)
    losses = {
        "elementwise": lambda w, b: 0.5 * jnp.sum(w * w) + 0.0 * jnp.mean(b["x"]),
        "dot-fed": lambda w, b: 0.5 * jnp.mean((b["x"] @ w) ** 2),
    }
    plan = asgd_jax.Plan(delays.Workers(1000), batch_size=8, chunk=10)
    made = asgd_jax.rules.get(rule, 0.01, **({"num_workers": 1000} if rule in ("ia2sgd", "dana") else {}))
    lowered = asgd_jax.simulator.lower(losses[loss_form], made, jnp.zeros(d), {"x": x}, plan)
    counts = _inventory(lowered.compile().as_text(), 1000, [(d,)])
    rows = 2 if rule in ("ia2sgd", "dana") else 1  # the pull's backup row (and the rule's table row), in place
    assert counts["stack dynamic-update-slice"] == rows, counts
    assert sum(v for k, v in counts.items() if k.startswith("stack ")) == rows, counts  # and no copy of a stack


@pytest.mark.parametrize("model", [delays.FixedDelay(0), delays.Workers(1)], ids=repr)
def test_a_single_slot_costs_what_sequential_sgd_costs(model, floor_copies):
    # One slot always holds w_t: the loop reads the live weights and writes the slot once per chunk, so the update
    # is plain SGD's (no slice, no write into the stack, no copy beyond the floor's).
    plan = asgd_jax.Plan(model, batch_size=BATCH, chunk=10)
    lowered = asgd_jax.simulator.lower(LOSS, asgd_jax.asgd(0.01), PARAMS, DATA, plan)
    counts = _inventory(lowered.compile().as_text(), model.num_slots, LEAVES)
    assert counts["param dynamic-slice"] == 0, counts
    assert counts["param dynamic-update-slice"] == 0, counts
    assert counts["param copy"] <= floor_copies, counts


@pytest.mark.parametrize(
    ("model", "mode"),
    [
        (delays.FixedDelay(0), "async"),
        (delays.Workers(1), "async"),
        (delays.Workers(3), "sync"),
        (delays.Workers(3), "async"),
        (delays.FixedDelay(2), "async"),
    ],
    ids=["FixedDelay(0)", "Workers(1)", "SSGD x3", "Workers(3)", "FixedDelay(2)"],
)
def test_the_result_does_not_depend_on_how_the_run_is_cut_into_chunks(model, mode):
    # A live slot (one slot, or SSGD) is written once per chunk, not per update: DC-ASGD must still see w_t as the
    # snapshot, whatever the chunk length (one update per chunk writes the slot every update).
    rule = asgd_jax.dc_asgd(0.01, 2.0, adaptive=True)
    x = np.random.default_rng(0).normal(size=(96, 4)).astype(np.float32)
    data = {"x": x, "y": x @ np.arange(1.0, 5.0, dtype=np.float32)}
    loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
    run = lambda every: asgd_jax.simulate(
        loss,
        rule,
        jnp.zeros(4),
        data,
        asgd_jax.Plan(model, mode=mode, batch_size=8, num_updates=40, chunk=every),
        progress=False,
    )
    one, whole = run(1), run(40)
    assert np.isfinite(whole.params).all() and whole.metrics["loss"][-1] < 0.5 * whole.metrics["loss"][0]
    np.testing.assert_allclose(one.params, whole.params, rtol=1e-6, atol=1e-7)


LOOP_CASES = {
    "Workers(8)": (delays.Workers(8), {}),
    "Workers(8) with stragglers": (delays.Workers(8, straggler_prob=0.2, straggler_slowdown=4.0), {}),
    "FixedDelay(3)": (delays.FixedDelay(3), {}),
    "RandomDelay(4)": (delays.RandomDelay(4), {}),
    "Trace": (delays.Trace([0, 2, 1, 0, 2, 1, 1, 0, 2, 0, 1, 2]), {"num_updates": 12}),
    "SSGD x3": (delays.Workers(3), {"mode": "sync"}),
    "Workers(8), n_sync 4": (delays.Workers(8), {"n_sync": 4, "push": "accumulate"}),
}


@pytest.mark.parametrize("case", list(LOOP_CASES))
def test_the_update_loop_holds_no_loop_of_its_own(case):
    # The data order's cycle walk and the delay model's random draws depend on neither the weights nor the rule:
    # the chunk computes them for all its updates before the first gradient. A loop inside the update loop would
    # ask the host whether to go on once per update on a GPU (a device-to-host copy and a wait each time).
    model, kwargs = LOOP_CASES[case]
    lowered = asgd_jax.simulator.lower(
        LOSS,
        asgd_jax.dc_asgd(0.01, 2.0, adaptive=True),
        PARAMS,
        DATA,
        asgd_jax.Plan(model, batch_size=BATCH, chunk=10, **kwargs),
    )
    assert _open_loops(lowered.compile().as_text()) == []
    # The reader finds such a loop where there is one: a plain SGD loop that walks the data order per minibatch.
    assert _open_loops(_floor_hlo()) == []
    assert len(_open_loops(_floor_hlo(walk_data_order=True))) == 1


@pytest.mark.parametrize("rule", ["dana", "inner adamw"])
def test_a_bfloat16_models_per_worker_stacks_are_updated_in_place(rule):
    """DANA's velocities and each worker's own AdamW state, one row of an [M, ...] stack written per update: a row
    written with ``.at[].set`` was a scatter whose bounds check XLA:CPU ran in float32 for a bfloat16 stack, converting
    and copying the whole stack on every update (``server.replace_row``, the simulator's workers' states)."""
    params = {"a": jnp.zeros(7, jnp.bfloat16), "b": jnp.zeros(5)}
    data = {"x": jnp.ones((64, 12)), "y": jnp.ones(64)}

    def loss(w, batch):
        flat = jnp.concatenate([w["a"].astype(jnp.float32), w["b"]])
        return 0.5 * jnp.mean((batch["x"] @ flat - batch["y"]) ** 2)

    if rule == "dana":
        made, kwargs = asgd_jax.rules.get("dana", 0.05, num_workers=8), {}
    else:
        made, kwargs = asgd_jax.asgd(0.05), {"inner": "adamw", "n_sync": 2, "push": "delta", "local_lr": 0.01}
    plan = asgd_jax.Plan(delays.Workers(8), batch_size=4, chunk=10, **kwargs)
    hlo = asgd_jax.simulator.lower(loss, made, params, data, plan).compile().as_text()
    assert "bf16[8,7]" in hlo
    assert not [line for line in hlo.splitlines() if "bf16[8," in line and " copy(" in line]
