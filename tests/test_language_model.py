"""The language-modelling task that runs offline: the grammar corpus, the decoder-only transformer (flax NNX), the
loss and perplexity per token, on both engines."""

from __future__ import annotations

import functools
import math
import re

import jax
import numpy as np
import optax
import pytest
from helpers.problems import replay_trainer_run
from hypothesis import given, settings
from hypothesis import strategies as st

import asgd_jax
from asgd_jax.errors import ConfigError
from asgd_jax.plan import Plan
from asgd_jax.trainer import TrainConfig, train

SMALL = {"width": 32, "depth": 1, "heads": 2}  # a transformer the size of these tests
WORDS = set(
    [
        "the",
        "a",
        "every",
        "some",
        "no",
        "cat",
        "dog",
        "bird",
        "child",
        "teacher",
        "river",
        "garden",
        "house",
        "song",
        "letter",
        "small",
        "old",
        "bright",
        "quiet",
        "red",
        "happy",
        "sees",
        "likes",
        "finds",
        "chases",
        "writes",
        "sings",
        "builds",
        "remembers",
        "near",
        "under",
        "behind",
        "with",
        "alice",
        "bob",
        "carol",
        "often",
        "rarely",
        "quietly",
        "today",
        "and",
        "but",
    ]
)


def _text(ids: np.ndarray) -> str:
    return "".join(asgd_jax.data.GRAMMAR_ALPHABET[i] for i in ids)


def test_the_grammar_corpus_is_made_offline_the_same_for_a_seed_and_labels_each_position_with_the_next_character():
    ds = asgd_jax.data.load("grammar")
    assert (ds.x_train.shape, ds.y_train.shape, ds.x_test.shape, ds.input_shape) == (
        (4096, 64),
        (4096, 64),
        (512, 64),
        (64,),
    )
    assert ds.x_train.dtype == ds.y_train.dtype == np.int32 and ds.num_classes == 28
    np.testing.assert_array_equal(ds.y_train[:, :-1], ds.x_train[:, 1:])  # the label is the next character
    # Consecutive windows cut one stream: a window's last label is the next window's first input.
    np.testing.assert_array_equal(ds.y_train[:-1, -1], ds.x_train[1:, 0])
    asgd_jax.data.clear_cache()
    again = asgd_jax.data.load("grammar")
    assert again is not ds
    np.testing.assert_array_equal(again.x_train, ds.x_train)
    np.testing.assert_array_equal(again.x_test, ds.x_test)
    other = asgd_jax.data.load("grammar", seed=1)
    assert not np.array_equal(other.x_train, ds.x_train)
    assert not np.array_equal(ds.x_test[:8], ds.x_train[:8])  # the held-out split is a stream of its own
    text = _text(ds.x_train[:64].reshape(-1))
    inner = re.split(r"[ .]+", text)[1:-1]  # (the first and last words may be cut)
    assert set(inner) <= WORDS and len(inner) > 500


@settings(max_examples=40, deadline=None)
@given(num_chars=st.integers(1, 3000), seed=st.integers(0, 2**31 - 1))
def test_grammar_text_is_sentences_of_the_grammars_words_for_any_seed(num_chars, seed):
    text = asgd_jax.data.grammar_text(num_chars, seed)
    assert len(text) >= num_chars and text == asgd_jax.data.grammar_text(num_chars, seed)
    assert text.endswith(".") and set(text) <= set(asgd_jax.data.GRAMMAR_ALPHABET)
    for sentence in text[:-1].split(". "):
        words = sentence.split(" ")
        assert set(words) <= WORDS and len(words) >= 2  # a noun phrase and a verb at least


@settings(max_examples=15, deadline=None)
@given(position=st.integers(0, 15), token=st.integers(0, 26), seed=st.integers(0, 2**16))
def test_the_transformer_is_causal(position, token, seed):
    # A token changes no logit of the positions before it: the model predicts each character from the ones before.
    model = asgd_jax.models.get("transformer", num_classes=28, input_shape=(16,), **SMALL)
    params, state = _init(model)
    tokens = np.random.default_rng(seed).integers(0, 28, size=(2, 16)).astype(np.int32)
    changed = tokens.copy()
    changed[:, position] = (tokens[:, position] + 1 + token) % 28  # (another token: token <= 26)
    before, after = (_logits(model)(params, state, t) for t in (tokens, changed))
    np.testing.assert_allclose(after[:, :position], before[:, :position], rtol=1e-5, atol=1e-6)
    assert not np.allclose(after[:, position:], before[:, position:])


@functools.cache
def _init(model):
    return model.init(jax.random.key(0))


@functools.cache
def _logits(model):
    """The model's logits, jitted (one program, where eagerly each of its ops compiles on its own)."""
    return jax.jit(lambda params, state, x: model.apply(params, state, x)[0])


def test_the_same_transformer_made_twice_is_one_model_and_its_options_are_checked_by_name():
    a = asgd_jax.models.get("transformer", num_classes=28, input_shape=(64,), **SMALL)
    b = asgd_jax.models.get("transformer", num_classes=28, input_shape=(64,), **SMALL)
    assert a == b and hash(a) == hash(b)  # (so its loss keys one compiled program)
    assert asgd_jax.classification_loss(a) == asgd_jax.classification_loss(b)
    assert "transformer" in asgd_jax.models.names()
    params, _ = a.init(jax.random.key(0))
    # Embeddings 28x32 + positions 64x32, one block (attention 4x32x32 + biases, MLP 32x128x32, two LayerNorms), the
    # final LayerNorm and the head 32x28.
    attention = 4 * (32 * 32 + 32)
    mlp = 32 * 128 + 128 + 128 * 32 + 32
    assert a.num_params(params) == 28 * 32 + 64 * 32 + attention + mlp + 2 * 64 + 64 + 32 * 28 + 28
    with pytest.raises(ConfigError, match=r"width=30 .* multiple of heads=4"):
        asgd_jax.models.get("transformer", num_classes=28, input_shape=(64,), width=30, heads=4)
    with pytest.raises(ConfigError, match=r"'transformer' takes width, depth, heads; not blocks"):
        asgd_jax.models.get("transformer", num_classes=28, input_shape=(64,), blocks=2)
    with pytest.raises(ConfigError, match=r"input_shape=\(8, 8, 1\) does not fit 'transformer'"):
        asgd_jax.models.get("transformer", num_classes=28, input_shape=(8, 8, 1))
    with pytest.raises(ConfigError, match=r"depth=0"):
        asgd_jax.models.get("transformer", num_classes=28, input_shape=(64,), depth=0)


def test_the_loss_and_error_are_per_token_and_the_perplexity_is_their_exponential():
    ds = asgd_jax.data.load("grammar")
    model = asgd_jax.models.get("transformer", num_classes=28, input_shape=ds.input_shape, **SMALL)
    params, state = _init(model)
    held_out = {"x": ds.x_test[:40], "y": ds.y_test[:40]}
    metrics = asgd_jax.classification_eval(model, held_out, batch_size=16)(params, state)  # 2 batches + a rest
    logits = _logits(model)(params, state, held_out["x"])
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, held_out["y"])  # [40, 64]
    np.testing.assert_allclose(metrics["loss"], per_token.mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["error"], (logits.argmax(-1) != held_out["y"]).mean(), rtol=1e-6)
    np.testing.assert_allclose(metrics["perplexity"], math.exp(float(metrics["loss"])), rtol=1e-5)
    digits = asgd_jax.data.load("digits")
    mlp = asgd_jax.models.get("mlp", num_classes=10, input_shape=digits.input_shape)
    assert set(asgd_jax.classification_eval(mlp, digits.test)(*mlp.init(jax.random.key(0)))) == {"loss", "error"}


def test_the_transformer_learns_the_grammar_in_the_simulator_and_a_trainer_run_replays(tmp_path):
    ds = asgd_jax.data.load("grammar")
    model = asgd_jax.models.get("transformer", num_classes=28, input_shape=ds.input_shape, **SMALL)
    params, state = _init(model)
    loss, rule = asgd_jax.classification_loss(model), asgd_jax.rules.get("asgd", 0.1)
    evaluate = asgd_jax.classification_eval(model, {"x": ds.x_test[:128], "y": ds.y_test[:128]})
    start = float(evaluate(params, state)["perplexity"])
    sim = asgd_jax.simulate(
        loss,
        rule,
        params,
        ds.train,
        Plan(asgd_jax.delays.Workers(4), batch_size=32, num_updates=300, eval_every=300),
        model_state=state,
        eval_fn=evaluate,
        progress=False,
    )
    # From about the vocabulary's size to well under half of it: the letters and spaces of words are learnt.
    assert start > 20 and float(evaluate(sim.params, sim.model_state)["perplexity"]) < 8
    config = TrainConfig(Plan(2, num_updates=12, batch_size=16), seed=4, out=str(tmp_path), progress=False)
    run = train(loss, rule, params, ds.train, config, model_state=state, devices=jax.devices()[:2])
    replay = replay_trainer_run(
        loss, rule, params, ds.train, run, num=2, batch_size=16, num_updates=12, model_state=state, seed=4
    )
    for a, b in zip(jax.tree.leaves(replay.params), jax.tree.leaves(run.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
