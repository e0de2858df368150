"""Bad arguments, generated: every public argument of the simulator, the sweep, the grid, the rule registry, the plan,
the trainer's config and the delay models, given a value it cannot take, raises a ``ConfigError`` (never another
exception, never a silent run) before anything compiles.

hypothesis draws the bad values (wrong types, NaN and infinities, out-of-range numbers, unknown names) per argument;
each property also holds the count of the engines' programs XLA compiled during the call at zero.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.compiles import compilations
from helpers.problems import DATA, W0, lsq_loss
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asgd_jax
from asgd_jax import delays, rules
from asgd_jax.errors import ConfigError

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Values that are no number at all, or not a usable one.
not_a_number = st.one_of(
    st.none(),
    st.booleans(),
    st.text(max_size=3),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(), st.integers(), max_size=1),
)
non_finite = st.sampled_from([math.nan, math.inf, -math.inf])
negative = st.one_of(st.integers(max_value=-1), st.floats(max_value=-1e-3, allow_nan=False, allow_infinity=False))
fraction = st.floats(min_value=0.01, max_value=0.99).map(lambda x: x + 1)  # 1.01 .. 1.99: not an int
bad_count = st.one_of(not_a_number, non_finite, negative, st.just(0), fraction)  # where an int >= 1 belongs
bad_rate = st.one_of(not_a_number, non_finite, negative)  # where a finite number >= 0 belongs
bad_name = st.text(min_size=1, max_size=8).filter(lambda s: s not in ("async", "sync", "gradients", "delta"))


def _raises_config_error_without_compiling(call, match=None):
    """The call raises a ConfigError (matching ``match``), and no program of the engines was compiled first (JAX's own
    eager helpers, such as the default key's seeding, may compile)."""
    with compilations() as counts, pytest.raises(ConfigError, match=match):
        call()
    ours = {name: n for name, n in counts.items() if name.startswith("simulator_")}
    assert not ours, ours


PLAN = asgd_jax.Plan(delays.Workers(2), batch_size=8, num_updates=8)


def _simulate(**changes):
    args = dict(loss_fn=lsq_loss, rule=asgd_jax.asgd(0.05), params=W0, data=DATA, plan=PLAN, key=jax.random.key(0))
    return lambda: asgd_jax.simulate(**{**args, **changes}, progress=False)


# --------------------------------------------------------------------------------------------------------------------
# simulate and sweep
# --------------------------------------------------------------------------------------------------------------------


@SETTINGS
@given(rule=st.one_of(not_a_number, st.sampled_from(["asgd", "dc_asgd_a"]), st.just(rules.asgd)))
def test_simulate_rejects_what_is_not_a_rule(rule):
    _raises_config_error_without_compiling(_simulate(rule=rule))


@SETTINGS
@given(
    params=st.one_of(
        not_a_number,
        st.just(np.arange(4)),  # ints
        st.just(np.full(4, np.nan, np.float32)),
        st.integers(min_value=1, max_value=7).filter(lambda n: n != 4).map(lambda n: np.zeros(n, np.float32)),
    )
)
def test_simulate_rejects_weights_it_cannot_train(params):
    _raises_config_error_without_compiling(_simulate(params=params))


@SETTINGS
@given(
    key=st.one_of(
        not_a_number.filter(lambda v: v is not None),  # None is the default key
        st.integers(),
        st.just(np.uint32(3)),
        st.integers(min_value=2, max_value=4).map(lambda n: jax.random.split(jax.random.key(0), n)),
    )
)
def test_simulate_rejects_what_is_not_one_key(key):
    _raises_config_error_without_compiling(_simulate(key=key))


@SETTINGS
@given(
    data=st.one_of(
        not_a_number,
        st.just({"x": DATA["x"][:, :3], "y": DATA["y"]}),  # shapes that do not fit the weights
        st.just({"x": DATA["x"][:4], "y": DATA["y"][:4]}),  # fewer examples than one minibatch per worker
        st.just({"x": DATA["x"], "y": DATA["y"][:50]}),  # leaves of different lengths
    )
)
def test_simulate_rejects_data_it_cannot_read(data):
    _raises_config_error_without_compiling(_simulate(data=data))


@SETTINGS
@given(
    plan=not_a_number.filter(lambda v: v is not None),  # None is the default plan
    on_nonfinite=st.one_of(not_a_number, bad_name),
    progress=st.one_of(st.text(max_size=3), st.integers(min_value=2), st.none()),
)
def test_simulate_rejects_a_bad_plan_policy_or_progress_flag(plan, on_nonfinite, progress):
    _raises_config_error_without_compiling(_simulate(plan=plan))
    _raises_config_error_without_compiling(_simulate(on_nonfinite=on_nonfinite))
    args = dict(loss_fn=lsq_loss, rule=asgd_jax.asgd(0.05), params=W0, data=DATA, plan=PLAN)
    _raises_config_error_without_compiling(lambda: asgd_jax.simulate(**args, progress=progress))


@SETTINGS
@given(
    eval_fn=st.one_of(
        not_a_number.filter(lambda v: v is not None),
        st.just(lambda p, s: 1.0),
        st.just(lambda p, s: {"e": jnp.zeros(3)}),
    )
)
def test_simulate_rejects_an_evaluation_that_is_not_a_dict_of_scalars(eval_fn):
    _raises_config_error_without_compiling(_simulate(eval_fn=eval_fn))


def test_simulate_rejects_a_checkpoint_folder_that_is_a_file(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    _raises_config_error_without_compiling(_simulate(checkpoint_dir=str(a_file)))
    _raises_config_error_without_compiling(_simulate(checkpoint_dir=5))


@SETTINGS
@given(
    keys=st.one_of(not_a_number, st.just(jax.random.key(0)), st.integers()),
    lam=st.one_of(
        st.none(), st.text(max_size=3), st.just([True, False]), st.just(jnp.ones((2, 2))), st.just(jnp.ones(3))
    ),
)
def test_sweep_rejects_keys_and_hyperparameters_of_the_wrong_shape_or_type(keys, lam):
    factory = lambda hp: asgd_jax.dc_asgd(0.05, hp["lam"], adaptive=True)
    good_keys, good_hp = asgd_jax.grid(seeds=[0, 1], lam=[1.0])
    run = lambda k, hp, rule=factory: asgd_jax.sweep(lsq_loss, rule, W0, DATA, PLAN, keys=k, hparams=hp, progress=False)
    _raises_config_error_without_compiling(lambda: run(keys, good_hp))
    _raises_config_error_without_compiling(lambda: run(good_keys, {"lam": lam}))
    _raises_config_error_without_compiling(lambda: run(good_keys, good_hp, rule=asgd_jax.dc_asgd))  # not a factory


@SETTINGS
@given(
    seeds=st.one_of(
        not_a_number.filter(lambda v: not isinstance(v, list) or v == []),
        st.lists(st.one_of(negative, st.integers(min_value=2**32), st.floats(allow_nan=True)), min_size=1, max_size=3),
    ),
    values=st.one_of(
        st.just([]),
        st.none(),
        st.text(max_size=3),
        st.lists(st.one_of(non_finite, st.text(max_size=2), st.none()), min_size=1, max_size=3),
    ),
)
def test_grid_rejects_bad_seeds_and_values(seeds, values):
    _raises_config_error_without_compiling(lambda: asgd_jax.grid(seeds=seeds))
    _raises_config_error_without_compiling(lambda: asgd_jax.grid(seeds=[0], lam=values))


# --------------------------------------------------------------------------------------------------------------------
# The rule registry, the plan, the trainer's config, the delay models
# --------------------------------------------------------------------------------------------------------------------


@SETTINGS
@given(
    name=st.one_of(not_a_number, st.text(max_size=8).filter(lambda s: s not in rules.names())),
    learning_rate=bad_rate,
    lam=bad_rate.filter(lambda v: v is not None),  # None: the rule's default
)
def test_rules_get_rejects_unknown_names_and_bad_numbers(name, learning_rate, lam):
    _raises_config_error_without_compiling(lambda: rules.get(name, 0.1))
    _raises_config_error_without_compiling(lambda: rules.get("asgd", learning_rate))
    _raises_config_error_without_compiling(lambda: rules.get("dc_asgd_a", 0.1, lam=lam))
    _raises_config_error_without_compiling(lambda: rules.get("asgd", 0.1, no_such_hyperparameter=1.0))


FLOATS = [np.float16, jnp.bfloat16, np.float32, np.float64]  # (NumPy does not count bfloat16 as a number)
LAM_SWEEP = lambda hp: asgd_jax.dc_asgd(0.05, hp["lam"], adaptive=True)  # (one object: one program per dtype)


@SETTINGS
@given(dtype=st.sampled_from(FLOATS), value=st.floats(0.01, 4.0), bad=non_finite)
def test_a_number_of_any_float_dtype_is_taken_where_a_number_belongs_and_a_non_finite_one_is_named(dtype, value, bad):
    number, nan = np.asarray(value, dtype), np.asarray(bad, dtype)
    scalar = number[()]  # (a bfloat16 scalar is an np.generic, no np.number)
    # A rule's numbers, a delay model's, a sweep's hyperparameters: taken (a bfloat16 one was "not a finite number").
    assert rules.get("dc_asgd_a", number, lam=number) is not None
    assert set(asgd_jax.recipes.of(rules.get("dc_asgd_a", scalar, lam=scalar)).numbers) >= {"learning_rate", "lam"}
    assert rules.weight_decayed(asgd_jax.asgd(0.1), scalar) is not None
    assert delays.Workers(3, sigma=number).sigma is number
    assert float(delays.Links(latency=number).latency) == float(np.float32(scalar))  # (kept in float32)
    assert asgd_jax.Plan(2, n_sync=2, push="delta", local_lr=scalar).local_lr == float(scalar)
    assert float(asgd_jax.grid(seeds=[0], lam=[scalar])[1]["lam"][0]) == float(np.float32(scalar))
    keys, _ = asgd_jax.grid(seeds=[0, 1])
    hparams = {"lam": np.full(2, value, dtype)}
    run = asgd_jax.sweep(lsq_loss, LAM_SWEEP, W0, DATA, PLAN, keys=keys, hparams=hparams, progress=False)
    assert run.params.shape[0] == 2 and np.isfinite(run.params).all()
    # The same dtype, not finite: refused, naming it.
    with pytest.raises(ConfigError, match="learning_rate"):
        rules.get("asgd", nan)
    with pytest.raises(ConfigError, match="sigma"):
        delays.Workers(3, sigma=nan)
    _raises_config_error_without_compiling(
        lambda: asgd_jax.sweep(
            lsq_loss, LAM_SWEEP, W0, DATA, PLAN, keys=keys, hparams={"lam": np.full(2, bad, dtype)}, progress=False
        )
    )


PLAN_COUNTS = ("num_updates", "batch_size", "n_sync")
PLAN_OPTIONAL_COUNTS = ("eval_every", "checkpoint_every", "chunk")


@SETTINGS
@given(
    field=st.sampled_from(PLAN_COUNTS + PLAN_OPTIONAL_COUNTS),
    value=bad_count.filter(lambda v: v is not None),
    delays_value=st.one_of(bad_count.filter(lambda v: v is not None), st.text(min_size=1, max_size=3)),
    mode=bad_name,
    local_lr=st.one_of(non_finite, negative, st.text(min_size=1, max_size=2), st.booleans()),
)
def test_plan_rejects_every_bad_field(field, value, delays_value, mode, local_lr):
    _raises_config_error_without_compiling(lambda: asgd_jax.Plan(2, **{field: value}))
    _raises_config_error_without_compiling(lambda: asgd_jax.Plan(delays_value))
    _raises_config_error_without_compiling(lambda: asgd_jax.Plan(2, mode=mode))
    _raises_config_error_without_compiling(lambda: asgd_jax.Plan(2, push=mode))
    _raises_config_error_without_compiling(lambda: asgd_jax.Plan(2, local_lr=local_lr))


TRAIN_BAD = {
    "seed": st.one_of(not_a_number, negative, st.integers(min_value=2**32), fraction),
    "devices_per_worker": bad_count,
    "out": st.one_of(st.integers(), st.booleans(), st.lists(st.text(), max_size=1), st.just("")),
    "resume": st.one_of(
        st.text(max_size=3).filter(lambda s: s != "auto"), st.integers(min_value=2), st.integers(max_value=-1)
    ),
    "warm_start_steps": st.one_of(not_a_number.filter(lambda v: v is not None), negative, fraction),
    "log_every": st.one_of(bad_rate, st.just(0)),
    "progress": st.one_of(st.text(max_size=3), st.integers(min_value=2), st.none()),
    "on_worker_failure": st.one_of(not_a_number, bad_name),
    "on_nonfinite": st.one_of(not_a_number, bad_name),
    "max_nonfinite": st.one_of(negative, st.just(0), fraction, st.text(max_size=2)),
    "slowdown": st.one_of(
        st.dictionaries(st.integers(min_value=2, max_value=9), st.floats(min_value=1, max_value=5), min_size=1),
        st.dictionaries(st.integers(min_value=0, max_value=1), st.floats(max_value=0.99), min_size=1),
        st.text(min_size=1, max_size=3),
    ),
    "timeout": st.one_of(bad_rate, st.just(0)),
    "backend": st.one_of(not_a_number, bad_name),
    "ray_address": st.one_of(st.integers(), st.booleans(), st.lists(st.text(), max_size=1)),
    "max_restarts": st.one_of(not_a_number.filter(lambda v: v is not None), negative, fraction),
    "store_device": st.one_of(
        st.integers(), st.none(), st.text(max_size=6).filter(lambda s: re.fullmatch(r"[a-z]+(:\d+)?", s) is None)
    ),
    "args": st.one_of(  # not a table; keys that are not strings; values JSON cannot hold
        st.lists(st.text(max_size=2), min_size=1, max_size=2),
        st.integers(),
        st.text(max_size=3),
        st.dictionaries(st.integers(), st.integers(), min_size=1, max_size=2),
        st.dictionaries(
            st.text(max_size=3),
            st.one_of(st.sampled_from([math.nan, math.inf, -math.inf]), st.builds(object), st.sets(st.integers())),
            min_size=1,
            max_size=2,
        ),
    ),
}

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=8,
)


@SETTINGS
@given(args=st.dictionaries(st.text(max_size=4), JSON_VALUES, max_size=4))
def test_train_config_keeps_any_table_of_json_values_as_json_reads_it_back(args):
    import json

    kept = asgd_jax.TrainConfig(asgd_jax.Plan(2), args=args).args
    assert kept == json.loads(json.dumps(args)) and json.loads(json.dumps(kept)) == kept


@SETTINGS
@given(data=st.data(), field=st.sampled_from(sorted(TRAIN_BAD)))
def test_train_config_rejects_every_bad_field(data, field):
    value = data.draw(TRAIN_BAD[field], label=field)
    _raises_config_error_without_compiling(lambda: asgd_jax.TrainConfig(asgd_jax.Plan(2), **{field: value}))


@SETTINGS
@given(
    num=bad_count,
    rate=st.one_of(bad_rate, st.just(0)),
    prob=st.one_of(not_a_number, non_finite, negative, st.floats(min_value=1.01, max_value=9)),
    kind=st.one_of(not_a_number, bad_name),
    tau=st.one_of(not_a_number, non_finite, negative, fraction),
)
def test_delay_models_reject_bad_numbers(num, rate, prob, kind, tau):
    _raises_config_error_without_compiling(lambda: delays.Workers(num))
    _raises_config_error_without_compiling(lambda: delays.Workers(2, mean_compute_time=rate))
    _raises_config_error_without_compiling(lambda: delays.Workers(2, straggler_prob=prob))
    _raises_config_error_without_compiling(lambda: delays.Workers(2, compute_time=kind))
    _raises_config_error_without_compiling(lambda: delays.Workers(2, speeds=[1.0, rate]))
    _raises_config_error_without_compiling(lambda: delays.FixedDelay(tau))
    _raises_config_error_without_compiling(lambda: delays.RandomDelay(tau))


@SETTINGS
@given(
    worker_ids=st.one_of(
        st.just([]),
        st.lists(st.floats(allow_nan=False, min_value=0.1, max_value=3.9), min_size=1, max_size=4),
        st.lists(st.integers(max_value=-1), min_size=1, max_size=3),
        st.text(min_size=1, max_size=3),
    ),
    skips=st.lists(st.integers(max_value=-1), min_size=3, max_size=3),
)
def test_a_trace_rejects_ids_and_skips_it_cannot_replay(worker_ids, skips):
    _raises_config_error_without_compiling(lambda: delays.Trace(worker_ids))
    _raises_config_error_without_compiling(lambda: delays.Trace([0, 1, 0], skips=skips))
    _raises_config_error_without_compiling(lambda: delays.Trace([0, 1, 0], skips=[0, 1]))


@SETTINGS
@given(
    pulled=st.lists(st.integers(min_value=-3, max_value=6), min_size=4, max_size=4).filter(
        lambda p: any(v < 0 or v > t for t, v in enumerate(p))
    ),
    ring=st.integers(max_value=0),
)
def test_a_trace_rejects_versions_it_cannot_replay(pulled, ring):
    """A version not yet made (pulled[t] > t) or negative, a version per update missing, a ring too short for the
    staleness it must hold, or a ring without versions: one clear error each, before anything compiles."""
    _raises_config_error_without_compiling(lambda: delays.Trace([0, 1, 0, 1], pulled=pulled))
    _raises_config_error_without_compiling(lambda: delays.Trace([0, 1, 0, 1], pulled=[0, 0, 1]))
    _raises_config_error_without_compiling(lambda: delays.Trace([0, 1, 0, 1], pulled=[0, 0, 0, 0], ring=3))
    _raises_config_error_without_compiling(lambda: delays.Trace([0, 1, 0, 1], pulled=[0, 0, 0, 0], ring=ring))
    _raises_config_error_without_compiling(lambda: delays.Trace([0, 1, 0, 1], ring=2))


@SETTINGS
@given(seeds=st.one_of(st.integers(), st.none(), st.floats(allow_nan=False), st.text(max_size=3)))
def test_compare_and_grid_refuse_seeds_that_are_not_a_list_naming_the_value(seeds):
    match = rf"seeds={re.escape(repr(seeds))} is invalid: give a (non-empty )?list of seeds"
    _raises_config_error_without_compiling(lambda: asgd_jax.grid(seeds=seeds, learning_rate=[0.1]), match)
    _raises_config_error_without_compiling(
        lambda: asgd_jax.compare(lsq_loss, W0, DATA, asgd_jax.Plan(2), {"asgd": {"learning_rate": [0.1]}}, seeds=seeds),
        match,
    )


def test_keys_of_the_wrong_shape_are_named_by_shape_not_dumped():
    keys = jax.random.split(jax.random.key(0), (2, 2))
    with pytest.raises(asgd_jax.ConfigError) as raised:
        asgd_jax.sweep(lsq_loss, asgd_jax.asgd(0.1), W0, DATA, asgd_jax.Plan(2, num_updates=5), keys=keys)
    message = str(raised.value)
    assert (
        message.startswith("keys='<keys of shape (2, 2)>' is invalid: give a 1-D array of keys") and "\n" not in message
    )
