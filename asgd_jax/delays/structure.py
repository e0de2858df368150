"""The structure/number split of a delay model: :func:`split` gives its :class:`Structure` (what a compiled program is
keyed on: class, static fields, literal zeros) and its numbers (the program's arguments).

Apart from :mod:`asgd_jax.delays.base` because the split knows one law: a :class:`~asgd_jax.delays.workers.Workers`
(or a cluster holding one) is seen as its programs see it, its numbers float32 and its missing speeds ones."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import numpy as np

from asgd_jax.delays.workers import Workers


class Structure(NamedTuple):
    """A delay model's static part: its class and static fields (the pytree structure) and which leaves are literal
    zeros. Hashable: it keys a compiled program, and :meth:`build` puts the numbers back in, traced or not.

    A literal ``0`` stays in the structure rather than becoming a traced number, because a zero can switch work off
    (``Workers(straggler_prob=0.0)`` draws no stragglers); every other number is an argument of the program.
    """

    treedef: Any
    zeros: tuple[tuple[int, Any], ...]  # (leaf index, the literal) of every literal-zero leaf

    def build(self, numbers: list[Any]) -> Any:
        """The delay model with ``numbers`` (the non-zero leaves, in order) put back."""
        numbers, zeros = iter(numbers), dict(self.zeros)
        leaves = [zeros[i] if i in zeros else next(numbers) for i in range(self.treedef.num_leaves)]
        return jax.tree.unflatten(self.treedef, leaves)


def split(model: Any) -> tuple[Structure, list[jax.Array]]:
    """``model``'s :class:`Structure` and its numbers (as given): what a compiled program is keyed on, and what it
    takes as arguments (so a model with other speeds, times or probabilities reuses the program).

    Example:
      >>> import asgd_jax
      >>> a, numbers = asgd_jax.delays.split(asgd_jax.delays.Workers(4, mean_compute_time=2.0))
      >>> b, _ = asgd_jax.delays.split(asgd_jax.delays.Workers(4, mean_compute_time=3.0))
      >>> a == b, len(numbers)  # all but straggler_prob and noise, whose zeros switch draws off: structure
      (True, 7)
      >>> split(asgd_jax.delays.Workers(4, speeds=[1.0, 2.0, 1.0, 0.5]))[0] == a  # a uniform cluster: speeds 1
      True
    """
    leaves, treedef = jax.tree.flatten(_as_compiled(model))
    literal = lambda x: isinstance(x, int | float) and not isinstance(x, bool) and x == 0
    zeros = tuple((i, x) for i, x in enumerate(leaves) if literal(x))
    numbers = [x for x in leaves if not literal(x)]
    return Structure(treedef, zeros), numbers


_SWITCHES = ("straggler_prob", "noise")
"""The numbers of :class:`Workers` whose literal zero switches a draw off: structure, not an argument."""


def _as_compiled(model: Any) -> Any:
    """``model`` as its programs see it: a :class:`Workers` without ``speeds`` has speeds 1, and its numbers given as
    Python numbers are float32 (a ``comm_time`` of 0 included), so a uniform cluster without communication cost shares
    its programs with every cluster of its size and law, whether a number came as ``2.0`` or ``np.float32(2.0)``; the
    times are the same bit for bit (a time divided by 1, or plus 0, is itself; the draws compute in float32). So does
    the cluster a Ringmaster, Rennala or m-Synchronous model holds. A zero that switches a draw off stays structure."""
    if isinstance(model, Workers):
        changes = {k: np.ones(model.num, np.float32) for k in ("speeds", "times") if getattr(model, k) is None}
        for field in dataclasses.fields(model):
            value = getattr(model, field.name)
            if field.name == "num" or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if value == 0 and field.name in _SWITCHES:
                continue  # no stragglers, no noise: no draw
            changes[field.name] = np.float32(value)
        return dataclasses.replace(model, **changes) if changes else model
    if isinstance(getattr(model, "workers", None), Workers) and dataclasses.is_dataclass(model):
        return dataclasses.replace(model, workers=_as_compiled(model.workers))
    return model
