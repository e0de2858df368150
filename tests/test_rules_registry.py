"""What every rule shares, pinned over the registry (a new rule registered in ``asgd_jax/rules/registry.py`` is run
through it without a line here), and the package's one face: every rule factory is an attribute of ``asgd_jax.rules``.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import pkgutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.compiles import compilations

import asgd_jax
from asgd_jax import packing, recipes, rules
from asgd_jax.trainer.state import programs

PARAMS = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.arange(3, dtype=jnp.bfloat16)}
GRADS = jax.tree.map(lambda p: (0.5 - p).astype(p.dtype), PARAMS)
F32 = {"w": PARAMS["w"], "b": PARAMS["b"].astype(jnp.float32)}
F32_GRADS = jax.tree.map(lambda p: 0.5 - p, F32)
F32_STALE = jax.tree.map(lambda p: 0.9 * p, F32)


def _built(name: str, learning_rate: float):
    """``rules.get(name, learning_rate)`` with what the rule cannot do without (a worker count)."""
    return rules.get(name, learning_rate, **{k: 3 for k in rules.required(name)})


@pytest.mark.parametrize("name", rules.names())
def test_a_registered_rules_first_step_without_staleness_is_finite_and_shaped_like_the_params(name):
    rule = _built(name, 0.1)
    state = rule.init(PARAMS)
    extra = {"stale_params": PARAMS, "staleness": jnp.int32(0), "worker": jnp.int32(0)}
    updates, new_state = rule.update(GRADS, state, PARAMS, **extra)
    assert jax.tree.structure(updates) == jax.tree.structure(PARAMS)
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    kind = lambda tree: jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), tree)
    assert kind(new_state) == kind(state)  # (a scan carries it: a bfloat16 weight's moment stays bfloat16)
    for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(PARAMS), strict=True):
        assert (u.shape, u.dtype) == (p.shape, p.dtype)
        assert bool(jnp.isfinite(u.astype(jnp.float32)).all())
    if callable(getattr(rule, "pull", None)):  # a pull rule sends weights shaped like the server's
        sent = rule.pull(PARAMS, new_state, jnp.int32(1))
        assert jax.tree.map(lambda x: (x.shape, x.dtype), sent) == jax.tree.map(lambda x: (x.shape, x.dtype), PARAMS)


@pytest.mark.parametrize("name", rules.names())
def test_a_registered_rule_compiles_once_per_structure_whatever_its_learning_rate(name):
    """As the simulator runs a rule: its recipe's numbers are the program's arguments, so rules of one name and
    structure with other numbers share one compiled program, and each computes what it computes on its own."""
    made = [_built(name, 0.1), _built(name, 0.05)]
    built = [recipes.of(rule) for rule in made]
    assert built[0].structure == built[1].structure
    traces = []

    @jax.jit
    def step(numbers, state, staleness, worker):
        traces.append(None)
        rule = recipes.Recipe(built[0].structure, numbers).build()
        return rule.update(F32_GRADS, state, F32, stale_params=F32_STALE, staleness=staleness, worker=worker)

    state = made[0].init(F32)
    extra = {"stale_params": F32_STALE, "staleness": jnp.int32(2), "worker": jnp.int32(1)}
    for rule, recipe in zip(made, built, strict=True):
        got, _ = step(recipe.numbers, state, extra["staleness"], extra["worker"])
        want, _ = rule.update(F32_GRADS, state, F32, **extra)
        jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7), got, want)
    assert len(traces) == 1


# Rules whose first two updates of the probe (one worker) do not reach the learning rate: a full round of M workers
# comes first. A resume checks them by their recipe.
ROUND_FIRST = {"fadas", "ia2sgd", "malenia", "ringleader"}


@pytest.mark.parametrize("name", rules.names())
def test_a_rules_fingerprint_is_one_program_whatever_its_learning_rate(name):
    """A run's start fingerprints its rule (the checkpoint's header): one compiled probe per rule structure and
    weights' shapes, the numbers its arguments, not an operation at a time compiled per leaf shape."""
    with compilations() as counts:
        prints = [rules.fingerprint(_built(name, lr), PARAMS) for lr in (0.1, 0.2, 0.1)]
    assert sum(counts.values()) <= 1, counts
    assert prints[0] == prints[2]
    assert (prints[0] == prints[1]) == (name in ROUND_FIRST)


@pytest.mark.parametrize("name", rules.names())
def test_a_rules_description_names_its_factory_under_asgd_jax_rules_whichever_file_defines_it(name):
    """The header a resumed run checks holds the rule's description: it stays what it was when the rules were one
    file, so that a run checkpointed then still resumes."""
    factory = rules.RULES[name]
    assert recipes.describe(_built(name, 0.1)).startswith(f"((asgd_jax.rules.{factory.__qualname__}, ")


def test_every_registered_factory_is_a_factory_of_asgd_jax_rules_or_a_preset_of_one():
    for name, factory in rules.RULES.items():
        if factory.__name__ == f"_named_{name}":  # a preset ("sgd", "dc_asgd_c", "dc_asgd_a"): rules.get builds it
            assert getattr(rules.registry, factory.__name__) is factory
        else:
            assert getattr(rules, factory.__name__) is factory, name
            assert factory.__name__ in rules.__all__


def _modules():
    return [importlib.import_module(m.name) for m in pkgutil.iter_modules(rules.__path__, "asgd_jax.rules.")]


def test_every_public_factory_and_type_of_the_package_is_an_attribute_of_asgd_jax_rules():
    """One face: whatever module defines a rule, ``asgd_jax.rules.<name>`` is it (``common``'s helpers are the rule
    modules' own, not a face; its ``PullRule`` is)."""
    public = {"PullRule": rules.common.PullRule}
    for module in _modules():
        public |= {n: v for n, v in vars(module).items() if getattr(v, "is_recipe", False) and not n.startswith("_")}
        if module.__name__ != "asgd_jax.rules.common":
            tree = ast.parse(pathlib.Path(module.__file__).read_text())
            defined = [n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)]
            public |= {n: vars(module)[n] for n in defined if not n.startswith("_")}
    assert len(public) >= 25  # 14 factories, 5 types, the registry's 6 functions
    for name, value in public.items():
        assert name in rules.__all__, name
        assert getattr(rules, name) is value, name


def test_the_top_level_rule_names_are_aliases_of_asgd_jax_rules():
    aliased = [n for n in asgd_jax.__all__ if n in rules.__all__]
    assert {"asgd", "dc_asgd", "scale_by_delay_compensation", "ScaleByDelayCompensationState"} <= set(aliased)
    for name in aliased:
        assert getattr(asgd_jax, name) is getattr(rules, name), name


# Leaves of one element, of a vector's tail (7, 9, 33) and a bfloat16 one: where XLA:CPU might compute a leaf
# otherwise than the same elements among others (a rule that reduces over a table of workers did, on a 1-element leaf).
MIXED = {
    "a": jnp.linspace(-1.0, 1.0, 7),
    "b": jnp.full((1,), 0.25),
    "c": jnp.sin(jnp.arange(33.0)).reshape(3, 11),
    "d": jnp.cos(jnp.arange(9.0)).astype(jnp.bfloat16),
}
DECLARED = [n for n in rules.names() if recipes.elementwise(_built(n, 0.1))]


def test_the_rules_declared_elementwise_are_those_of_plain_arithmetic():
    """What the store applies to the packed weights: every rule but those that reduce (a compressor's top-k or
    random draw, a mean over a table of workers) or whose Adam-like arithmetic XLA:CPU rounds otherwise in a longer
    buffer (FADAS, CGAD: a last bit at a buffer's ends)."""
    assert set(rules.names()) - set(DECLARED) == {
        "fadas", "cgad", "gap_aware", "ia2sgd", "malenia", "ringleader", "topk_asgd", "randk_asgd"
    }  # fmt: skip
    assert not recipes.elementwise(optax.chain(optax.sgd(0.1)))  # composed by hand: nothing known
    assert recipes.elementwise(rules.one_of(0, [asgd_jax.asgd(0.1), asgd_jax.dc_asgd(0.1)]))
    assert not recipes.elementwise(rules.one_of(0, [asgd_jax.asgd(0.1), rules.get("topk_asgd", 0.1, num_workers=2)]))
    assert not recipes.elementwise(rules.chained_before(optax.add_decayed_weights(0.1), asgd_jax.asgd(0.1)))


@pytest.mark.parametrize("name", DECLARED)
def test_a_rule_declared_elementwise_gives_the_same_bits_on_the_packed_weights(name):
    """Five exchanges, three workers, every staleness the server makes: leaf by leaf, and on the weights packed into
    one buffer per dtype with the rule's state packed alike (``Layout.pack_within``), the same bits. (A stand-in: two
    XLA:CPU programs may round a leaf's last bit otherwise for other shapes; what must hold is that a trainer run
    replays in the simulator bit for bit, tests/test_trainer.py's thirty leaves.)"""
    rule, layout = _built(name, 0.1), packing.Layout.of(MIXED)
    step = jax.jit(lambda s, g, w: asgd_jax.server.exchange(rule, s, w, g)[0])
    trees, packed = asgd_jax.server.init(rule, MIXED, 3), asgd_jax.server.init(rule, layout.pack(MIXED), 3)
    for i in range(5):
        grads = jax.tree.map(lambda x, i=i: (jnp.cos(x.astype(jnp.float32) * (i + 2)) - 0.3).astype(x.dtype), MIXED)
        trees, packed = step(trees, grads, jnp.int32(i % 3)), step(packed, layout.pack(grads), jnp.int32(i % 3))
        want = (
            layout.pack(trees.params),
            layout.pack_within(trees.opt_state),
            jax.vmap(layout.pack)(trees.backup_params),
        )
        same = jax.tree.map(np.array_equal, want, (packed.params, packed.opt_state, packed.backup_params))
        assert all(jax.tree.leaves(same)), (i, same)
    back = layout.unpack_within(packed.opt_state, trees.opt_state)
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, back, trees.opt_state)))
    # And the parameter store does step it packed (it keeps the pytree, silently, where the packing does not fit).
    assert programs(rule, 3, MIXED, None)[0].stored_layout.works_packed
