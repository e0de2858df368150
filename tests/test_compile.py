"""A run is one value, compiled once: counted compilations over notebook-style loops, numbers as arguments, and what
"the same bits" covers."""

from __future__ import annotations

import dataclasses
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.compiles import compilations
from helpers.problems import NOISY as DATA
from helpers.problems import W1 as W0
from helpers.problems import B, lsq_loss

import asgd_jax
from asgd_jax import delays, rules


def _simulator(counts) -> dict[str, int]:
    return {k: v for k, v in counts.items() if k.startswith("simulator_")}


def test_a_notebook_loop_of_ten_runs_compiles_the_update_chunk_once():
    """The learning rate, lambda, the seed, the budget, the workers' speeds and the initial weights change from call to
    call: every one is an argument of the same programs."""
    asgd_jax.simulator.clear_cache()
    eval_fn = lambda w, _: {"loss": lsq_loss(w, DATA)}
    even = (1.0, 1.0, 1.0, 1.0)
    calls = [
        (0.05, 2.0, 0, 200, even, W0),
        (0.10, 2.0, 0, 200, even, W0),
        (0.05, 0.5, 0, 200, even, W0),
        (0.05, 2.0, 1, 200, even, W0),
        (0.05, 2.0, 2, 300, even, W0),
        (0.05, 2.0, 0, 250, even, W0),  # 250 = 5 chunks of 50; 230 ends in a shorter part: the same program
        (0.05, 2.0, 0, 230, even, W0),
        (0.05, 2.0, 0, 210, (1.0, 0.5, 0.25, 1.0), W0),  # 10 more: the chunk program takes any length
        (0.02, 1.0, 3, 200, (2.0, 1.0, 1.0, 1.0), W0),
        (0.05, 2.0, 0, 200, even, 2 * W0),
    ]
    finals = []
    with compilations() as counts:
        for lr, lam, seed, budget, speeds, w0 in calls:
            speeds = np.asarray(speeds, np.float32)
            plan = asgd_jax.Plan(delays.Workers(4, speeds=speeds), batch_size=B, num_updates=budget, eval_every=50)
            rule = asgd_jax.dc_asgd(lr, lam, adaptive=True)
            result = asgd_jax.simulate(
                lsq_loss, rule, jnp.asarray(w0), DATA, plan, key=jax.random.key(seed), eval_fn=eval_fn, progress=False
            )
            finals.append(np.asarray(result.params))
    expected = {"simulator_start": 1, "simulator_chunk": 1, "simulator_eval": 1}
    assert _simulator(counts) == expected, counts
    assert len({f.tobytes() for f in finals}) == len(calls)  # every call's numbers reached its run


def test_a_loss_is_traced_once_for_its_check_and_once_for_the_update_program():
    """Tracing is a compiled program's Python share (a cnn's update program: ~0.15 s, paid again in every process,
    the persistent cache reads the trace): the loss is traced to check it before anything compiles and once more in
    the update program, whose loop reads the step's one trace for its outputs' shapes and its body alike; a run at
    other numbers traces nothing."""
    asgd_jax.simulator.clear_cache()
    traced = []

    def loss(w, batch):
        traced.append(1)
        return lsq_loss(w, batch)

    plan = asgd_jax.Plan(delays.Workers(4), batch_size=B, num_updates=60, chunk=25)
    runs = [
        asgd_jax.simulate(loss, asgd_jax.asgd(lr), jnp.asarray(W0), DATA, plan, progress=False) for lr in (0.1, 0.2)
    ]
    assert len(traced) == 2
    assert not np.array_equal(runs[0].params, runs[1].params)


def test_on_an_accelerator_whole_chunks_run_in_a_scan_of_known_length_with_the_same_bits(monkeypatch):
    """On a CPU every chunk runs in the chunk program (its trip count an argument: one program for whole chunks and a
    run's last part); on an accelerator, whole chunks run in a scan of known length, for XLA:GPU asks the host about a
    loop of unknown trip count on every trip. Forced here on the CPU: the same bits, the scan compiled, and the chunk
    program only for a budget that is not a whole number of chunks."""
    assert not asgd_jax.simulator.programs.scans_whole_chunks("cpu")
    assert asgd_jax.simulator.programs.scans_whole_chunks("gpu") and asgd_jax.simulator.programs.scans_whole_chunks(
        "tpu"
    )
    plan = asgd_jax.Plan(delays.Workers(3), batch_size=B, num_updates=50, chunk=20)
    run = lambda budget: asgd_jax.simulate(
        lsq_loss, asgd_jax.dc_asgd(0.05, 2.0), jnp.asarray(W0), DATA, plan.replace(num_updates=budget), progress=False
    )
    asgd_jax.simulator.clear_cache()
    with compilations() as counts:
        cpu = run(50)
    assert _simulator(counts) == {"simulator_start": 1, "simulator_chunk": 1}, counts
    monkeypatch.setattr(asgd_jax.simulator.programs, "scans_whole_chunks", lambda platform: True)
    asgd_jax.simulator.clear_cache()
    with compilations() as counts:
        whole = run(40)
    assert _simulator(counts) == {"simulator_start": 1, "simulator_scan": 1}, counts
    with compilations() as counts:
        scanned = run(50)
    assert _simulator(counts) == {"simulator_chunk": 1}, counts  # (the last 10 updates)
    leaves = lambda r: jax.tree.leaves((r.state, r.metrics))
    for a, b in zip(leaves(cpu), leaves(scanned), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(whole.metrics["loss"], cpu.metrics["loss"][:40])


def test_a_uniform_cluster_runs_in_the_program_of_any_cluster_of_its_size_and_law():
    """A notebook starts with Workers(4) and then tries speeds, a communication cost or a float32 number: no second
    compilation. A uniform cluster is compiled as speeds 1, comm_time 0 as a number and Python numbers as float32; a
    time divided by 1, or plus 0, is itself, so they give the same bits (also inside Ringmaster)."""
    plan = lambda model: asgd_jax.Plan(model, batch_size=B, num_updates=40, chunk=20)
    run = lambda model: asgd_jax.simulate(
        lsq_loss, asgd_jax.asgd(0.05), jnp.asarray(W0), DATA, plan(model), progress=False
    )
    for wrap in (lambda w: w, lambda w: delays.Ringmaster(w, 2)):
        asgd_jax.simulator.clear_cache()
        uniform = run(wrap(delays.Workers(4)))
        with compilations() as counts:
            ones = run(wrap(delays.Workers(4, speeds=np.ones(4, np.float32))))
            other = run(wrap(delays.Workers(4, speeds=[1.0, 0.5, 2.0, 1.0])))
            talking = run(wrap(delays.Workers(4, comm_time=0.5)))  # a cost per exchange: a number too
            typed = run(wrap(delays.Workers(4, mean_compute_time=np.float32(1.0))))  # not a Python float: the same
        assert _simulator(counts) == {}, counts
        np.testing.assert_array_equal(uniform.metrics["time"], ones.metrics["time"])
        np.testing.assert_array_equal(uniform.params, ones.params)
        np.testing.assert_array_equal(uniform.metrics["time"], typed.metrics["time"])
        assert not np.array_equal(uniform.metrics["time"], other.metrics["time"])
        assert not np.array_equal(uniform.metrics["time"], talking.metrics["time"])


# One rule of each way a recipe holds its numbers: a preset of a factory, ints declared numbers, a seed beside a static
# fraction, a pull rule, per-worker tables under a required worker count, a None among the numbers. That every
# registered rule's numbers are arguments of the program that rebuilds it is tests/test_rules_registry.py's (one
# trace for two learning rates, each rule); here, that the simulator keys its programs on the recipe.
RECIPE_KINDS = ["dc_asgd_a", "fadas", "randk_asgd", "dana", "ringleader", "cgad"]


def test_rules_built_by_name_with_other_numbers_share_one_program():
    plan = asgd_jax.Plan(delays.Workers(3), batch_size=B, num_updates=20, chunk=20)
    assert set(RECIPE_KINDS) <= set(rules.names())
    for name in RECIPE_KINDS:
        hp = {k: 3 for k in rules.required(name)}
        first, second = rules.get(name, 0.05, **hp), rules.get(name, 0.01, **hp)
        with compilations() as counts:
            a = asgd_jax.simulate(lsq_loss, first, jnp.asarray(W0), DATA, plan, progress=False)
            b = asgd_jax.simulate(lsq_loss, second, jnp.asarray(W0), DATA, plan, progress=False)
        assert _simulator(counts).get("simulator_chunk", 0) <= 1, (name, counts)
        assert not np.array_equal(a.params, b.params), name


def test_a_rule_of_ones_own_compiles_once_per_object_and_a_new_object_each_call_is_named():
    plan = asgd_jax.Plan(delays.Workers(3), batch_size=B, num_updates=20, chunk=20)
    make = lambda: optax.sgd(0.05)  # an optax rule: a closure, keyed by its identity
    mine = make()
    with compilations() as counts, warnings.catch_warnings():
        warnings.simplefilter("error", asgd_jax.simulator.RecompileWarning)
        for _ in range(3):
            asgd_jax.simulate(lsq_loss, mine, jnp.asarray(W0), DATA, plan, progress=False)
    assert _simulator(counts)["simulator_chunk"] == 1
    with pytest.warns(asgd_jax.simulator.RecompileWarning, match="the rule is a new object with the same code"):
        asgd_jax.simulate(lsq_loss, make(), jnp.asarray(W0), DATA, plan, progress=False)
    with warnings.catch_warnings():  # said once: a loop that makes its rule anew is not told on every call
        warnings.simplefilter("error", asgd_jax.simulator.RecompileWarning)
        asgd_jax.simulate(lsq_loss, make(), jnp.asarray(W0), DATA, plan, progress=False)


def test_a_sweep_with_other_numbers_or_delays_compiles_nothing_new():
    plan = asgd_jax.Plan(delays.Workers(3, straggler_prob=0.1), batch_size=B, num_updates=40, chunk=20)
    keys, hp = asgd_jax.grid(seeds=[0, 1], learning_rate=[0.05, 0.02], lam=[0.0, 1.0])
    with compilations() as counts:
        for p in (0.1, 0.3):
            for budget in (40, 60):
                asgd_jax.sweep(
                    lsq_loss,
                    asgd_jax.dc_asgd(0.1, 0.5),
                    jnp.asarray(W0),
                    DATA,
                    plan.replace(num_updates=budget, delays=delays.Workers(3, straggler_prob=p)),
                    keys=keys,
                    hparams=hp,
                    progress=False,
                )
    assert _simulator(counts) == {"simulator_start": 1, "simulator_chunk": 1}, counts


def test_the_initial_weights_and_the_rules_numbers_are_arguments_not_constants():
    big = jnp.linspace(-1.0, 1.0, 4)  # values a constant would spell out
    plan = asgd_jax.Plan(delays.Workers(2), batch_size=B, chunk=10)
    lowered = asgd_jax.simulator.lower(lsq_loss, asgd_jax.dc_asgd(0.0123, 0.0456), big, DATA, plan)
    text = lowered.as_text()
    assert "0.0123" not in text and "0.0456" not in text and "1.230000e-02" not in text
    args = jax.tree.leaves(lowered.args_info)
    assert sum(np.size(a.shape) and int(np.prod(a.shape)) == 4 for a in args) >= 1  # the weights come in


# --------------------------------------------------------------------------------------------------------------------
# The same bits: what is covered.
# --------------------------------------------------------------------------------------------------------------------


def _sweep(seeds, budget=60):
    keys, hp = asgd_jax.grid(seeds=seeds, learning_rate=[0.05])
    plan = asgd_jax.Plan(delays.Workers(4), batch_size=B, num_updates=budget)
    rule = asgd_jax.dc_asgd(0.05, 2.0, adaptive=True)
    return asgd_jax.sweep(lsq_loss, rule, jnp.asarray(W0), DATA, plan, keys=keys, hparams=hp, progress=False)


def test_a_sweeps_row_does_not_depend_on_the_other_runs_or_their_number():
    two, five = _sweep([3, 4]), _sweep([0, 1, 2, 3, 4])
    for name in two.metrics:
        np.testing.assert_array_equal(two.metrics[name], five.metrics[name][3:], err_msg=name)
    np.testing.assert_array_equal(two.params, five.params[3:])


def test_a_run_alone_agrees_with_its_row_in_a_sweep_to_float_rounding():
    plan = asgd_jax.Plan(delays.Workers(4), batch_size=B, num_updates=60)
    alone = asgd_jax.simulate(
        lsq_loss, asgd_jax.dc_asgd(0.05, 2.0, adaptive=True), jnp.asarray(W0), DATA, plan, key=jax.random.key(3)
    )
    row = _sweep([3, 4])
    np.testing.assert_array_equal(alone.metrics["worker"], row.metrics["worker"][0])  # the same schedule, exactly
    np.testing.assert_allclose(alone.params, row.params[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [7, 60, 100])
def test_the_last_shorter_chunk_is_bit_for_bit_the_same_updates(chunk):
    plan = asgd_jax.Plan(delays.Workers(3, straggler_prob=0.2), batch_size=B, num_updates=60)
    rule = asgd_jax.dc_asgd(0.05, 2.0, adaptive=True)
    run = lambda p: asgd_jax.simulate(lsq_loss, rule, jnp.asarray(W0), DATA, p, key=jax.random.key(1), progress=False)
    whole, cut = run(plan.replace(chunk=60)), run(plan.replace(chunk=chunk))
    for a, b in zip(jax.tree.leaves(whole.state), jax.tree.leaves(cut.state), strict=True):
        np.testing.assert_array_equal(a, b)
    for name in whole.metrics:
        np.testing.assert_array_equal(whole.metrics[name], cut.metrics[name], err_msg=name)


def test_a_study_compiles_two_programs_per_arm_and_one_evaluation_per_run_count():
    """`asgd-jax ablate`: each arm compiles its start and its chunk, and no program of a shorter last chunk (a study's
    budget is a whole number of evaluation intervals); the evaluation is shared by every arm of the same number of
    runs (one model, one eval_fn), whatever its rule and cluster."""
    from asgd_jax import studies

    tiny = dict(dataset="digits", seeds=(0, 1), epochs=0.5, evals=2, window=10, workers=(1, 2))
    arms = studies.load("dcasgd_table1").arms(dataclasses.replace(studies.load("dcasgd_table1").quick, **tiny), True)
    asgd_jax.simulator.clear_cache()
    with compilations() as counts:
        result = studies.ablate(progress=False, **tiny)
    assert len(arms) == 3 and len(result.runs) == 2 * 5
    run_counts = {len(a.variants) * 2 for a in arms}
    assert len(run_counts) == 2  # M = 1 and SSGD: 2 runs; the asynchronous arm: 3 rules x 2 seeds
    expected = {"simulator_start": len(arms), "simulator_chunk": len(arms), "simulator_eval": len(run_counts)}
    assert _simulator(counts) == expected, counts


# --------------------------------------------------------------------------------------------------------------------
# How XLA:CPU compiles each program: faster, the same bits.
# --------------------------------------------------------------------------------------------------------------------


def _without_cpu_options(monkeypatch) -> None:
    monkeypatch.setattr(asgd_jax.models, "CPU_INIT_OPTIONS", {})


@pytest.mark.parametrize("name", ["mlp", "cnn", "convnet", "resnet20"])
def test_a_models_initial_weights_are_the_same_bits_as_with_xlas_defaults(name, monkeypatch):
    make = lambda: asgd_jax.models.get(name, num_classes=10, input_shape=(8, 8, 3))
    fast = make().init(jax.random.key(7))
    _without_cpu_options(monkeypatch)
    plain = make().init(jax.random.key(7))
    for a, b in zip(jax.tree.leaves(fast), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(a, b)


def _options_seen(monkeypatch) -> list:
    """Records the XLA options of every program compiled through ``asgd_jax.cache.compile_with``: (name, options)."""
    seen, compile_with = [], asgd_jax.cache.compile_with

    def recording(lowered, options):
        seen.append((lowered.as_text().split("module @", 1)[1].split()[0], options))  # (the program's name)
        return compile_with(lowered, options)

    monkeypatch.setattr(asgd_jax.cache, "compile_with", recording)
    return seen


@pytest.mark.parametrize(
    "plan",
    [
        asgd_jax.Plan(delays.Workers(8), batch_size=B, num_updates=40, chunk=20),
        asgd_jax.Plan(delays.Workers(3, compute_time="lognormal"), batch_size=B, num_updates=40, chunk=20),
        asgd_jax.Plan(delays.Workers(3), batch_size=B, num_updates=40, chunk=20, n_sync=4, push="accumulate"),
    ],
    ids=["exponential", "lognormal", "n_sync4"],
)
def test_a_runs_start_compiled_light_on_a_cpu_gives_the_run_of_xlas_defaults(plan, monkeypatch):
    """The start, once per run, compiles with CPU_START_OPTIONS; the run is the one XLA's defaults give: the same
    weights, losses and staleness bit for bit, the clock at most a last bit apart (a first compute time drawn as a
    sum of n_sync draws)."""
    assert asgd_jax.simulator.programs.CPU_START_OPTIONS  # (what the second run below does without)
    run = lambda: asgd_jax.simulate(lsq_loss, asgd_jax.dc_asgd(0.01, 2.0), jnp.asarray(W0), DATA, plan, progress=False)
    asgd_jax.simulator.clear_cache()
    seen = _options_seen(monkeypatch)
    light = run()
    options = dict(seen)  # the start with the options, the updates with XLA's defaults
    assert options == {
        "jit_simulator_start": asgd_jax.simulator.programs.CPU_START_OPTIONS,
        "jit_simulator_chunk": None,
    }
    monkeypatch.setattr(asgd_jax.simulator.programs, "CPU_START_OPTIONS", {})
    asgd_jax.simulator.clear_cache()
    plain = run()
    np.testing.assert_array_equal(light.params, plain.params)
    for name in ("loss", "staleness"):
        np.testing.assert_array_equal(light.metrics[name], plain.metrics[name])
    np.testing.assert_allclose(light.metrics["time"], plain.metrics["time"], rtol=1e-6)
    asgd_jax.simulator.clear_cache()


def test_an_xla_option_this_jaxlib_does_not_know_falls_back_to_xlas_defaults(monkeypatch):
    """The lighter options of a model's initialisation and a run's start are XLA debug options: a jaxlib that drops
    one compiles those programs with its defaults instead of failing every run."""
    unknown = {"xla_an_option_no_jaxlib_has": True}
    plan = asgd_jax.Plan(delays.Workers(3), batch_size=B, num_updates=20, chunk=20)
    run = lambda: asgd_jax.simulate(lsq_loss, asgd_jax.asgd(0.05), jnp.asarray(W0), DATA, plan, progress=False)
    make = lambda: asgd_jax.models.get("mlp", num_classes=10, input_shape=(8, 8, 1))
    _without_cpu_options(monkeypatch)
    monkeypatch.setattr(asgd_jax.simulator.programs, "CPU_START_OPTIONS", {})
    asgd_jax.simulator.clear_cache()
    plain_run, plain_init = run(), make().init(jax.random.key(1))
    monkeypatch.setattr(asgd_jax.models, "CPU_INIT_OPTIONS", unknown)
    monkeypatch.setattr(asgd_jax.simulator.programs, "CPU_START_OPTIONS", unknown)
    asgd_jax.simulator.clear_cache()
    asgd_jax.cache.clear()  # (what this process learnt of the option set before: told again)
    seen = _options_seen(monkeypatch)
    with pytest.raises(jax.errors.JaxRuntimeError, match="No such compile option"):  # (what is caught)
        jax.jit(lambda x: x + 1).lower(1.0).compile(unknown)
    with pytest.warns(UserWarning, match="does not know an XLA option") as said:
        light_run = run()
        light_init = make().init(jax.random.key(1))
    assert len(said) == 1  # once for the option set, whichever program met it first
    for a, b in zip(jax.tree.leaves(light_run.state), jax.tree.leaves(plain_run.state), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(light_init), jax.tree.leaves(plain_init), strict=True):
        np.testing.assert_array_equal(a, b)
    assert [name for name, options in seen if options == unknown] == ["jit_simulator_start", "jit__lambda"]
    asgd_jax.simulator.clear_cache()


def test_a_models_initialisation_also_runs_inside_a_callers_program():
    """`jit`, `vmap` and `eval_shape` trace the initialisation into their own program (XLA's options are a top-level
    program's); the weights are those of the call outside."""
    model = asgd_jax.models.get("cnn", num_classes=10, input_shape=(8, 8, 1))
    key = jax.random.key(3)
    params, _ = model.init(key)
    shapes = jax.eval_shape(model.init, key)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), shapes[0]) == jax.tree.map(lambda a: (a.shape, a.dtype), params)
    inside, _ = jax.jit(model.init)(key)
    batched, _ = jax.vmap(model.init)(jax.random.split(key, 2))
    for a, b, c in zip(jax.tree.leaves(params), jax.tree.leaves(inside), jax.tree.leaves(batched), strict=True):
        np.testing.assert_array_equal(a, b)
        assert c.shape == (2, *a.shape)
    raw, _ = model.init(jax.random.PRNGKey(3))  # a raw uint32 key: a program of its own shape
    assert jax.tree.structure(raw) == jax.tree.structure(params)
    for device in jax.devices()[1:3]:  # a key on another device: the weights there, the same numbers
        there, _ = model.init(jax.device_put(key, device))
        assert {leaf.devices().pop() for leaf in jax.tree.leaves(there)} == {device}
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(there), strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_model_that_initialised_still_pickles_and_its_copy_gives_the_same_weights():
    import pickle

    model = asgd_jax.models.get("mlp", num_classes=10, input_shape=(8, 8, 1))
    params, _ = model.init(jax.random.key(2))  # its compiled initialisation is kept on it
    copy = pickle.loads(pickle.dumps(model))
    assert copy == model
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(copy.init(jax.random.key(2))[0]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_model_built_again_initialises_without_compiling_anything():
    # A model is a value: the same call builds an equal model (a notebook cell run again, a study's next arm), and its
    # initialisation is the one compiled before, found without tracing, lowering or loading (each cost ~0.2 s on a CPU
    # with the persistent cache warm). Other numbers, or other XLA options, are another program.
    make = lambda **options: asgd_jax.models.get("mlp", num_classes=10, input_shape=(8, 8, 1), **options)
    asgd_jax.cache.clear()  # (what an earlier test kept: this one counts from nothing)
    first = make().init(jax.random.key(4))
    with compilations() as again:
        second = make().init(jax.random.key(5))  # (another key, the same program)
    assert sum(again.values()) == 0
    with compilations() as other:
        make(hidden=(16,)).init(jax.random.key(4))
    assert sum(other.values()) == 1
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(make().init(jax.random.key(4))), strict=True):
        np.testing.assert_array_equal(a, b)
    pairs = zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True)
    assert not all(np.array_equal(a, b) for a, b in pairs)  # (the second key's weights, from the same program)
    # Its own jitted initialisation is then first made inside a caller's trace: it must not keep that trace's values
    # (a dummy input made with jnp there was the trace's tracer, leaked on the caller's next call).
    fresh = make()
    fresh.init(jax.random.key(4))
    for _ in range(2):
        inside = jax.jit(fresh.init)(jax.random.key(4))
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(inside), strict=True):
            np.testing.assert_array_equal(a, b)
    # A NumPy key has no device: its weights land on the default device of the call, not of the one that compiled.
    raw = np.asarray(jax.random.key_data(jax.random.key(4)))
    for device in jax.devices()[1::-1]:
        with jax.default_device(device):
            placed, _ = make().init(raw)
        assert {leaf.devices().pop() for leaf in jax.tree.leaves(placed)} == {device}
    asgd_jax.cache.clear()  # forgets them: the next build compiles (loads) again
    with compilations() as cleared:
        make().init(jax.random.key(4))
    assert sum(cleared.values()) == 1


@pytest.mark.parametrize("key", [0, "key", None, [0, 1]])
def test_a_model_initialised_with_no_key_says_what_to_give(key):
    model = asgd_jax.models.get("mlp", num_classes=10, input_shape=(8, 8, 1))
    with pytest.raises(asgd_jax.ConfigError, match=r"key=.* is invalid: give a PRNG key, e.g. jax.random.key\(0\)"):
        model.init(key)


def test_the_compile_census_books_each_program_to_the_test_that_compiled_it(tmp_path):
    # experiments/benchmarks/compile_census.py reads what each pytest process writes: per test, XLA's seconds and
    # programs. (A program found in the persistent cache counts as its load: each program here holds a constant drawn
    # afresh, so that no earlier run of the suite left it there and each is compiled.)
    from helpers.compiles import Census

    fresh = float(np.random.default_rng().uniform(1, 2))
    census = Census(str(tmp_path / "census"))
    try:
        census.start("first")
        jax.jit(lambda x: x * fresh + 1.0).lower(np.float32(1)).compile()
        census.start("second")
        for k in (2, 3):
            jax.jit(lambda x, k=k: jnp.sin(x * fresh) ** k).lower(np.ones(k, np.float32)).compile()
        census.write("gw9")
    finally:
        census.close()
    counted = json.loads((tmp_path / "census.gw9.json").read_text())
    assert {k: n for k, (_, n) in counted["tests"].items()} == {"first": 1, "second": 2}
    assert all(s > 0 for s, _ in counted["tests"].values())
    assert counted["programs"]["<lambda>"][1] == 3  # and by program name, across the tests
    assert counted["programs"]["<lambda>"][0] == pytest.approx(sum(s for s, _ in counted["tests"].values()))
