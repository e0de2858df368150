"""One description of a training setup: the studies' full forms and ``asgd-jax train --config`` are the same numbers.

The shipped configs equal the studies' setups field by field; the rule the training script builds from a setup
(schedule with warm-up and decay, momentum, weight decay) equals a study arm's rule update by update; the loss
(augmentation) and the evaluation are the same functions; bf16 computes in bf16 and keeps float32 weights.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.problems import DATA, W0, lsq_loss

import asgd_jax
from asgd_jax import cli, rules, schedules, setups, studies
from asgd_jax.errors import ConfigError
from asgd_jax.plan import Plan

CIFAR10_TRAIN = 50_000


def _args(*argv: str):
    return cli.parse(["train", *argv])


def _setup_fields(setup) -> dict:
    return setups.Setup.setup_fields(setup)


def test_the_shipped_dcasgd_config_is_the_studies_cifar10_setup():
    args = _args("--config", "dcasgd_cifar10")
    assert _setup_fields(cli.setup_of(args)) == _setup_fields(studies.DCASGD_CIFAR10)
    # 160 effective epochs of a 128-example minibatch: the study's epochs, in updates.
    assert args.num_updates == round(studies.DCASGD_CIFAR10.epochs * CIFAR10_TRAIN / 128)
    assert (args.rule, args.lam) == ("dc_asgd_a", studies.load("dcasgd_table1").full.lam_a)


def test_the_shipped_gpu_asgd_config_is_the_nsync_studys_full_form():
    full = studies.load("gpu_asgd_nsync").full
    args = _args("--config", "gpu_asgd_cifar10")
    mine = _setup_fields(cli.setup_of(args))
    theirs = _setup_fields(full)
    # The study's learning rate is the clients' local one; the server adds the deltas at 1 (its arms' server_lr).
    assert mine.pop("learning_rate") == 1.0 and args.local_lr == theirs.pop("learning_rate")
    assert mine == theirs
    assert (args.push, args.n_sync) == ("delta", 10)
    per_update = 128 * args.n_sync
    assert args.warm_start_steps == round(full.warm_epochs * CIFAR10_TRAIN / per_update)
    assert args.num_updates - args.warm_start_steps == round(full.epochs * CIFAR10_TRAIN / per_update)


def test_a_shipped_setup_is_found_by_name_and_a_missing_one_is_one_line(capsys):
    assert set(cli.shipped_configs()) >= {"dcasgd_cifar10", "gpu_asgd_cifar10"}
    assert cli.main(["train", "--config", "no_such_setup"]) == 2
    assert "no shipped setup of that name (dcasgd_cifar10, gpu_asgd_cifar10" in capsys.readouterr().err


def _drive(rule, steps: int, seed: int = 0) -> list[np.ndarray]:
    """``steps`` updates of ``rule`` on random gradients and stale weights (a worker's view), the updates returned."""
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.normal(size=6), jnp.float32)
    state, out = rule.init(w), []
    update = jax.jit(lambda g, s, w, stale, tau: rule.update(g, s, w, stale_params=stale, staleness=tau, worker=1))
    for _ in range(steps):
        g = jnp.asarray(rng.normal(size=6), jnp.float32)
        stale = w + jnp.asarray(0.1 * rng.normal(size=6), jnp.float32)
        u, state = update(g, state, w, stale, jnp.int32(rng.integers(0, 4)))
        w = w + u
        out.append(np.asarray(u))
    return out


@pytest.mark.parametrize(
    "flags",
    [
        ("--schedule", "step", "--warmup", "2", "--unit", "epoch", "--weight-decay", "1e-3"),
        ("--schedule", "cosine", "--decay-factor", "0.05", "--warmup", "0.1", "--momentum", "0.9"),
        ("--schedule", "step", "--decay-at", "100", "300", "--unit", "update", "--momentum", "0.5"),
    ],
    ids=["step, warm-up in epochs, weight decay", "cosine, warm-up fraction, momentum", "steps in updates"],
)
def test_the_trainers_rule_is_the_study_arms_rule_update_by_update(flags):
    """The same setup, through the training script's flags and through a study arm: 1,000 updates alike, past the
    warm-up and every decay (mnist1d: 4,000 examples, 125 updates an epoch at batch 32)."""
    num_updates, num_examples = 1000, 4000
    args = _args("--rule", "dc_asgd_a", "--lam", "2", "--lr", "0.4", "--workers", "4", *flags)
    setup = cli.setup_of(args)
    plan = Plan(4, num_updates=num_updates, batch_size=32)
    trainer_rule = cli.train_rule(args, setup, plan, num_examples)
    settings = studies.Settings(**{**setups.Setup.setup_fields(setup)})
    arm = studies.Arm(
        {"M": 4}, plan, variants=(studies.Variant("DC-ASGD-a", rule="dc_asgd", hp={"lam": 2.0, "adaptive": 1.0}),)
    )
    arm_rule = studies.arm_rule(arm, settings, num_updates, num_examples / 32)({"lam": 2.0, "adaptive": 1.0})
    for a, b in zip(_drive(trainer_rule, num_updates), _drive(arm_rule, num_updates), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)


def test_schedules_are_optax_arithmetic_and_numbers_of_the_program():
    import optax

    cos = schedules.cosine(0.5, 100, 0.1)
    ref = optax.cosine_decay_schedule(0.5, 100, 0.1)
    np.testing.assert_allclose([cos(t) for t in range(0, 130, 7)], [ref(t) for t in range(0, 130, 7)], rtol=1e-6)
    warm = setups.Setup(schedule="step", decay_at=(50,), warmup=10, unit="update").learning_rate_schedule(100)
    assert [round(float(warm(t)), 4) for t in (0, 4, 9, 49, 50)] == [0.05, 0.25, 0.5, 0.5, 0.05]
    # Other numbers, the same structure: one compiled program.
    a = asgd_jax.recipes.of(rules.get("asgd", setups.Setup(warmup=0.1).learning_rate_schedule(400)))
    b = asgd_jax.recipes.of(rules.get("asgd", setups.Setup(warmup=0.2, learning_rate=0.1).learning_rate_schedule(900)))
    assert a.structure == b.structure and a.numbers != b.numbers


def test_weight_decay_is_the_rule_on_the_regularised_gradient_and_keeps_a_pull_rule_pulling():
    w, g = jnp.array([2.0, -1.0]), jnp.array([0.5, 0.5])
    decayed = rules.weight_decayed(rules.get("dc_asgd_a", 0.1), 0.01)
    plain = rules.get("dc_asgd_a", 0.1)
    a, _ = decayed.update(g, decayed.init(w), w, stale_params=w - 0.1)
    b, _ = plain.update(g + 0.01 * w, plain.init(w), w, stale_params=w - 0.1)
    np.testing.assert_allclose(a, b, rtol=1e-7)
    dana = rules.weight_decayed(rules.get("dana", 0.1, num_workers=2), 0.01)
    assert asgd_jax.server.has_pull(dana)
    result = asgd_jax.simulate(
        lsq_loss, dana, W0, DATA, Plan(2, batch_size=8, num_updates=30), key=jax.random.key(0), progress=False
    )
    assert np.isfinite(np.asarray(result.params)).all()


def test_the_trainer_and_a_study_share_the_loss_and_the_evaluation():
    ds = asgd_jax.data.load("digits")
    args = _args("--dataset", "digits", "--model", "cnn", "--augment", "--eval-crop", "6", "--eval-multi-crop")
    setup = cli.setup_of(args)
    settings = studies.Settings(**setups.Setup.setup_fields(setup))
    model = setup.build_model(ds.num_classes, ds.input_shape)
    params, state = model.init(jax.random.key(0))
    batch = {"x": ds.x_train[:16], "y": ds.y_train[:16]}
    ours, theirs = setup.loss(model), settings.loss(model)
    assert ours == theirs  # one value: it keys one program
    a = ours(params, state, batch, jax.random.key(3))[0]
    plain = asgd_jax.classification_loss(model)(params, state, batch, jax.random.key(3))[0]
    assert float(a) == float(theirs(params, state, batch, jax.random.key(3))[0]) and float(a) != float(plain)
    assert setup.evaluation(model, ds.test)(params, state) == settings.evaluation(model, ds.test)(params, state)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"schedule": "linear"}, r"schedule='linear' \(--schedule\) is invalid"),
        ({"decay_at": (0.75, 0.5)}, "give increasing positions"),
        ({"decay_at": (0.5, 1.5)}, "fractions of the run are < 1"),
        ({"unit": "hours"}, r"unit='hours' \(--unit\)"),
        ({"warmup": -1.0}, r"warmup=-1.0 \(--warmup\)"),
        ({"weight_decay": float("nan")}, r"weight_decay=nan \(--weight-decay\)"),
        ({"dtype": "float16"}, r"dtype='float16' \(--dtype\)"),
        ({"eval_multi_crop": True}, r"needs eval_crop"),
        ({"augment": "yes"}, r"augment='yes' \(--augment\)"),
        ({"model_options": [1]}, "model_options"),
    ],
)
def test_a_bad_setup_is_named(changes, message):
    with pytest.raises(ConfigError, match=message):
        setups.Setup(**changes)


def test_the_config_file_types_the_new_flags(tmp_path, capsys):
    config = tmp_path / "c.toml"
    config.write_text('decay_at = ["soon"]\n')
    assert cli.main(["train", "--config", str(config)]) == 2
    assert "decay_at = ['soon'] is invalid: give a list of numbers" in capsys.readouterr().err
    config.write_text("model_options = 5\n")
    assert cli.main(["train", "--config", str(config)]) == 2
    assert "model_options = 5 is invalid: give a table" in capsys.readouterr().err
    config.write_text("model_options = { hidden = [16] }\ndecay_at = [10, 20]\nunit = 'update'\n")
    args = _args("--config", str(config))
    assert args.model_options == {"hidden": [16]} and cli.setup_of(args).decay_at == (10.0, 20.0)


# --------------------------------------------------------------------------------------------------------------------
# bf16
# --------------------------------------------------------------------------------------------------------------------


def test_bf16_computes_in_bf16_with_float32_weights_gradients_and_state():
    model = asgd_jax.models.get("resnet20", num_classes=10, input_shape=(8, 8, 3), blocks_per_stage=1, dtype="bfloat16")
    params, state = model.init(jax.random.key(0))
    batch = {"x": jnp.ones((4, 8, 8, 3)), "y": jnp.arange(4)}
    loss = asgd_jax.classification_loss(model)
    # (jitted: one program each, where eagerly every op of the network compiled on its own)
    grad = jax.jit(jax.grad(lambda p: loss(p, state, batch, jax.random.key(1)), has_aux=True))
    grads, (new_state, _) = grad(params)
    assert {x.dtype for x in jax.tree.leaves((params, grads, new_state))} == {jnp.dtype(jnp.float32)}
    logits = jax.jit(lambda m, p: m.apply(p, state, batch["x"])[0], static_argnums=0)
    assert "bf16" in logits.lower(model, params).as_text()  # the convolutions run in bf16
    full = dataclasses.replace(model, dtype="float32")
    np.testing.assert_allclose(logits(model, params), logits(full, params), atol=0.1)


def test_a_bf16_trainer_run_converges_and_its_trace_replays_with_the_same_policy(tmp_path):
    ds = asgd_jax.data.load("digits")
    model = asgd_jax.models.get("mlp", num_classes=10, input_shape=ds.input_shape, dtype="bfloat16")
    params, state = model.init(jax.random.key(0))
    loss, evaluate = asgd_jax.classification_loss(model), asgd_jax.classification_eval(model, ds.test)
    config = asgd_jax.TrainConfig(Plan(2, num_updates=600, batch_size=32), seed=1, out=str(tmp_path), progress=False)
    result = asgd_jax.train(
        loss,
        rules.get("asgd", 0.1),
        params,
        ds.train,
        config,
        model_state=state,
        eval_fn=evaluate,
        devices=jax.devices()[:2],
    )
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(result.params))
    error = evaluate(result.params, result.model_state)["error"]
    assert float(error) < 0.15  # 600 updates of a 10-way problem: far below chance (0.9)
    replay = asgd_jax.simulate(
        loss,
        rules.get("asgd", 0.1),
        params,
        ds.train,
        asgd_jax.trainer.replay_plan(tmp_path),
        model_state=state,
        key=jax.random.key(1),
        progress=False,
    )
    # bf16 rounds what XLA keeps in float32 differently in the workers' and the simulator's fused programs, so the
    # replay is close, not bit for bit (float32 replays are exact: test_trainer.py). Measured over the weights as a
    # whole: one small leaf (the first layer's biases) amplifies those roundings by as much as the run's staleness
    # pattern, which timing decides (0.02-0.13 relative over 20 runs on a loaded 2-core machine), while the whole
    # stays within about 1% (0.006-0.011).
    flat = lambda tree: jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(tree)])
    whole = jnp.linalg.norm(flat(replay.params) - flat(result.params)) / jnp.linalg.norm(flat(result.params))
    assert float(whole) < 0.05
    assert abs(float(evaluate(replay.params, replay.model_state)["error"]) - float(error)) < 0.02
