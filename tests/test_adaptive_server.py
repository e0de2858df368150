"""The asynchronous adaptive server rules of the DiLoCo line, FADAS (Wang et al., ICML 2024) and CGAD (Shah & Sun
2026), each against a float64 NumPy reference written from its definition over a recorded push order (the references
count their own versions and delays; they share no code with asgd_jax), and their properties."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.problems import PUSH_ORDER, W1, replay_order, simulate_lsq
from hypothesis import given, settings
from hypothesis import strategies as st

from asgd_jax import delays, rules
from asgd_jax.errors import ConfigError

LR = 0.05


class _Versions:
    """What a server counts: pushes applied, and the version each worker pulled."""

    def __init__(self, num=3):
        self.w, self.count, self.pulled = np.array(W1, np.float64), 0, dict.fromkeys(range(num), 0)

    def staleness(self, worker):
        return self.count - self.pulled[worker]

    def pull(self, worker):
        self.pulled[worker] = self.count
        return self.w.copy()


class FadasRef(_Versions):
    def __init__(self, size, lr=LR, b1=0.9, b2=0.99, eps=1e-8, threshold=None, scaling="min", bias=True):
        super().__init__()
        self.lr = lr
        zeros = lambda: np.zeros(len(W1))
        self.m, self.v, self.v_hat, self.buffer, self.delays, self.t = zeros(), zeros(), zeros(), zeros(), [], 0
        self.size, self.b1, self.b2, self.eps, self.threshold, self.scaling, self.bias = (
            size, b1, b2, eps, threshold, scaling, bias
        )  # fmt: skip

    def push(self, worker, g, sent):
        # The delay in server steps (rounds): steps taken between the worker's pull and now.
        self.delays.append(self.count // self.size - self.pulled[worker] // self.size)
        self.buffer = self.buffer + g
        self.count += 1
        if self.count % self.size:
            return
        self.t += 1
        mean = self.buffer / self.size
        self.m = self.b1 * self.m + (1 - self.b1) * mean
        self.v = self.b2 * self.v + (1 - self.b2) * mean**2
        self.v_hat = np.maximum(self.v_hat, self.v)
        eta, tau = self.lr, max(self.delays)
        if self.threshold is not None and tau > self.threshold:
            eta = min(self.lr, 1 / tau) if self.scaling == "min" else self.lr / tau
        c1, c2 = (1 - self.b1**self.t, 1 - self.b2**self.t) if self.bias else (1.0, 1.0)
        self.w = self.w - eta / c1 * self.m / (np.sqrt(self.v_hat / c2) + self.eps)
        self.buffer, self.delays = np.zeros_like(self.buffer), []


class CgadRef(_Versions):
    def __init__(self, decay, cutoff, b1=0.9, b2=0.999, eps=1e-8):
        super().__init__()
        self.m, self.v, self.t = np.zeros(len(W1)), np.zeros(len(W1)), 0
        self.decay, self.cutoff, self.b1, self.b2, self.eps = decay, cutoff, b1, b2, eps

    def push(self, worker, g, sent):
        tau = self.staleness(worker)
        gate = (
            1.0 if self.cutoff is None else (0.5 * (1 + np.cos(np.pi * tau / self.cutoff)) if tau < self.cutoff else 0)
        )
        g = gate * np.exp(-self.decay * tau) * g
        self.t += 1
        self.m = self.b1 * self.m + (1 - self.b1) * g
        self.v = self.b2 * self.v + (1 - self.b2) * g**2
        m_hat, v_hat = self.m / (1 - self.b1**self.t), self.v / (1 - self.b2**self.t)
        self.w = self.w - LR * m_hat / (np.sqrt(v_hat) + self.eps)
        self.count += 1


CASES = {
    "fadas M=3": (lambda: rules.fadas(LR, buffer_size=3), lambda: FadasRef(3)),
    "fadas M=1, no bias correction": (
        lambda: rules.fadas(LR, buffer_size=1, bias_correction=False),
        lambda: FadasRef(1, bias=False),
    ),
    # The order's delays reach 3 steps at M = 2: a threshold of 1 cuts some steps' learning rate and not others
    # (min(eta, 1 / tau) with eta 0.4: the cut sets the step where it applies).
    "fadas M=2, delay-adaptive (paper)": (
        lambda: rules.fadas(0.4, buffer_size=2, delay_threshold=1),
        lambda: FadasRef(2, lr=0.4, threshold=1),
    ),
    "fadas M=2, delay-adaptive (code)": (
        lambda: rules.fadas(LR, buffer_size=2, delay_threshold=1, delay_scaling="divide"),
        lambda: FadasRef(2, threshold=1, scaling="divide"),
    ),
    "cgad": (lambda: rules.cgad(LR, decay=0.2, cutoff=4), lambda: CgadRef(0.2, 4)),
    "cgad without the gate (Adam-Decay)": (lambda: rules.cgad(LR, cutoff=None), lambda: CgadRef(0.1, None)),
}


@pytest.mark.parametrize("case", CASES)
def test_the_rule_matches_its_papers_reference_over_a_recorded_order(case):
    make_rule, make_ref = CASES[case]
    ref = make_ref()
    replay_order(ref.push, ref.pull)
    result = simulate_lsq(make_rule(), delays.Trace(PUSH_ORDER, num=3), num_updates=len(PUSH_ORDER))
    np.testing.assert_allclose(result.params, ref.w, rtol=1e-4, atol=1e-5)


def test_fadas_moves_the_weights_only_when_its_buffer_is_full():
    rule = rules.fadas(0.1, buffer_size=3)
    w = jnp.zeros(2)
    state = rule.init(w)
    moved = []
    for i in range(9):
        update, state = rule.update(jnp.array([1.0, -2.0]) * (i + 1), state, w, staleness=jnp.int32(0))
        moved.append(bool(jnp.any(update != 0)))
    assert moved == [False, False, True] * 3
    assert int(state.steps) == 3 and int(state.count) == 9
    np.testing.assert_array_equal(state.buffer, jnp.zeros(2))  # emptied by the step


def test_cgad_at_age_zero_is_adam_bit_for_bit():
    rule, adam = rules.cgad(0.1, decay=0.3, cutoff=5), optax.adam(0.1)
    w = jnp.array([0.5, -1.0, 2.0])
    s1, s2 = rule.init(w), adam.init(w)
    for i in range(5):
        g = jnp.sin(w * (i + 1))
        u1, s1 = rule.update(g, s1, w, staleness=jnp.int32(0))
        u2, s2 = adam.update(g, s2, w)
        np.testing.assert_array_equal(u1, u2)


@settings(max_examples=60, deadline=None)
@given(
    decay=st.floats(0.0, 2.0),
    cutoff=st.one_of(st.none(), st.floats(0.5, 64.0)),
    ages=st.lists(st.integers(0, 100), min_size=2, max_size=6),
)
def test_the_age_factor_is_one_at_age_zero_then_falls_to_zero_at_the_cutoff(decay, cutoff, ages):
    rule = rules.scale_by_age(decay, cutoff)
    factor = lambda t: float(rule.update(jnp.ones(1), rule.init(None), staleness=jnp.int32(t))[0][0])
    assert factor(0) == 1.0
    values = [factor(t) for t in sorted(ages)]
    assert all(0.0 <= v <= 1.0 for v in values)
    assert all(a >= b - 1e-7 for a, b in itertools.pairwise(values))  # never rises with age
    if cutoff is not None:
        assert all(v == 0.0 for t, v in zip(sorted(ages), values, strict=True) if t >= cutoff)


def test_a_push_past_the_cutoff_adds_nothing_to_the_moments():
    rule = rules.cgad(0.1, cutoff=4)
    w = jnp.zeros(2)
    state = rule.init(w)
    _, state = rule.update(jnp.array([1.0, 2.0]), state, w, staleness=jnp.int32(1))
    _, late = rule.update(jnp.array([100.0, -7.0]), state, w, staleness=jnp.int32(4))
    _, zero = rule.update(jnp.zeros(2), state, w, staleness=jnp.int32(0))
    jax.tree.map(np.testing.assert_array_equal, late, zero)  # as if it pushed nothing (the moments still decay)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(["buffer_size", "b1", "b2", "eps", "delay_threshold", "decay", "cutoff"]),
    value=st.one_of(st.floats(-1e3, -1e-6), st.just(float("nan")), st.just(float("inf"))),
)
def test_a_bad_hyperparameter_is_refused_by_name_before_anything_runs(name, value):
    factory = rules.cgad if name in ("decay", "cutoff") else rules.fadas
    with pytest.raises(ConfigError, match=name):
        factory(0.1, **{name: value})


def test_an_unknown_delay_scaling_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match=r"delay_scaling.*'min', 'divide'"):
        rules.fadas(0.1, delay_scaling="max")
