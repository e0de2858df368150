"""What makes a rule of rules (no paper): :func:`weight_decayed` (a rule on the L2-regularised gradient, a pull
rule keeping its pull) and :func:`one_of` (the rule ``choices[index]`` with the index possibly traced, so that a sweep
runs several rules in one compiled program).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from asgd_jax import errors
from asgd_jax.recipes import recipe
from asgd_jax.rules.common import PullRule


@recipe(numbers=("rate",), elementwise=True)
def weight_decayed(rule: Any, rate: float | jax.Array) -> Any:
    r"""``rule`` applied to the regularised gradient :math:`g + \text{rate} \cdot w_t`: L2 weight decay on the server's
    current weights, chained before the rule (``optax.chain(optax.add_decayed_weights(rate), rule)``). DC-ASGD then
    compensates the regularised gradient. A pull rule keeps its pull.

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> rule = asgd_jax.rules.weight_decayed(asgd_jax.asgd(0.1), 0.5)
      >>> w = jnp.array([2.0])
      >>> rule.update(jnp.array([1.0]), rule.init(w), w)[0]  # -0.1 * (1 + 0.5 * 2)
      Array([-0.2], dtype=float32)
    """
    errors.require(
        isinstance(rate, jax.core.Tracer) or (errors.is_number(rate) and float(rate) >= 0),
        "weight_decay",
        rate,
        "use a finite number >= 0",
    )
    return chained_before(optax.add_decayed_weights(rate), rule)


def chained_before(first: Any, rule: Any) -> Any:
    """``optax.chain(first, rule)``, the server's extra arguments handed to what takes them; a pull rule keeps its
    pull (what :func:`weight_decayed` and :func:`asgd_jax.rules.compressed` build)."""
    # optax.chain hands the extra arguments (stale_params, staleness, worker) only to what it knows takes them.
    inner = (
        rule
        if isinstance(rule, optax.GradientTransformationExtraArgs)
        else optax.GradientTransformationExtraArgs(rule.init, rule.update)
    )
    chained = optax.chain(first, inner)
    if not callable(getattr(rule, "pull", None)):
        return chained
    return PullRule(chained.init, chained.update, lambda params, state, worker: rule.pull(params, state[1], worker))


# A concrete index picks the rule at compile time; a traced one (a sweep's) at run time.
@recipe(static=("index",), elementwise=True)
def one_of(index: int | jax.Array, choices: Sequence[Any]) -> optax.GradientTransformationExtraArgs | PullRule:
    """The rule ``choices[index]``, with ``index`` possibly traced: a sweep runs different rules in one program.

    The state holds every choice's state and only the chosen one's changes, so a run is the chosen rule's run. Under
    ``vmap`` with a batched index every choice is computed and one is selected: a rule costs O(parameters), small
    beside a gradient, except that a rule with a per-worker table (``ia2sgd``, ``ringleader_asgd``, ``dana``, a
    per-worker ``dc_asgd``) then has its whole ``[n, ...]`` table selected on every update, O(n d) where the rule alone
    writes one row: measured (``experiments/benchmarks/one_of_tables.py``), 12 runs of ``one_of([asgd, ia2sgd])``
    on MNIST-1D's MLP of 289k parameters took 22.7, 46.3 and 138.6 ms an update at n = 4, 16, 64 against 14.4-14.6 for
    ``ia2sgd`` alone. Give such rules a sweep of their own. A :class:`PullRule` when any choice is one (the others
    send the weights as they are).

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> rule = asgd_jax.rules.one_of(jnp.int32(1), [asgd_jax.asgd(0.1), asgd_jax.asgd(0.5)])
      >>> w = jnp.ones(2)
      >>> rule.update(jnp.ones(2), rule.init(w), w, staleness=jnp.int32(0))[0]
      Array([-0.5, -0.5], dtype=float32)
    """
    choices = [c if isinstance(c, PullRule) else optax.with_extra_args_support(c) for c in choices]
    if not choices:
        raise errors.ConfigError("one_of needs at least one rule in choices.")
    index = jnp.asarray(index, jnp.int32)

    def init_fn(params):
        return tuple(c.init(params) for c in choices)

    def update_fn(updates, state, params=None, **extra_args):
        def branch(i):
            def chosen(state):
                step, new = choices[i].update(updates, state[i], params, **extra_args)
                return step, (*state[:i], new, *state[i + 1 :])

            return chosen

        return jax.lax.switch(index, [branch(i) for i in range(len(choices))], state)

    if not any(isinstance(c, PullRule) for c in choices):
        return optax.GradientTransformationExtraArgs(init_fn, update_fn)

    def pull_fn(params, state, worker):
        sends = [
            (lambda st, c=c, i=i: c.pull(params, st[i], worker)) if isinstance(c, PullRule) else (lambda st: params)
            for i, c in enumerate(choices)
        ]
        return jax.lax.switch(index, sends, state)

    return PullRule(init_fn, update_fn, pull_fn)
