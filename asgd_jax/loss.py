"""A loss function with its form declared: with or without model state, with or without auxiliary metrics.

The engines differentiate a loss in one normalised form (:meth:`Loss.normalized`); how a user's function is called is
declared with it, never guessed from what it returns, and checked once on a minibatch's shapes before anything
compiles (:meth:`Loss.check`). :func:`asgd_jax.classification_loss` returns one.

Example:
  >>> import jax.numpy as jnp, asgd_jax
  >>> loss = asgd_jax.Loss(lambda w, b: jnp.mean((b["x"] @ w) ** 2))
  >>> loss.has_model_state, loss.has_aux
  (False, False)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from asgd_jax import errors

__all__ = ["Loss", "as_loss"]


# --------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Loss:
    """A loss function and its declared form.

    ======================  =================================================================================
    declared                 ``fn`` is
    ======================  =================================================================================
    (neither)                ``fn(params, batch) -> loss``
    ``has_aux``              ``fn(params, batch) -> (loss, aux)``
    ``has_model_state``      ``fn(params, model_state, batch, key) -> (loss, new_model_state)``
    both                     ``fn(params, model_state, batch, key) -> (loss, (new_model_state, aux))``
    ======================  =================================================================================

    ``aux`` is a dict of scalar training metrics (e.g. ``{"error": ...}``); ``key`` drives the model's randomness
    (dropout, augmentation). :func:`asgd_jax.classification_loss` returns a ``Loss`` with both declared.
    """

    fn: Callable
    has_model_state: bool = False
    has_aux: bool = False

    def __post_init__(self):
        errors.require(callable(self.fn), "loss_fn", self.fn, "give a function")
        for name in ("has_model_state", "has_aux"):
            errors.require(isinstance(getattr(self, name), bool), name, getattr(self, name), "use True or False")

    def __call__(self, *args):
        return self.fn(*args)

    @property
    def form(self) -> str:
        """The declared form, as a signature."""
        args = "params, model_state, batch, key" if self.has_model_state else "params, batch"
        out = {
            (False, False): "loss",
            (False, True): "(loss, aux)",
            (True, False): "(loss, new_model_state)",
            (True, True): "(loss, (new_model_state, aux))",
        }[(self.has_model_state, self.has_aux)]
        return f"loss_fn({args}) -> {out}"

    def normalized(self) -> Callable:
        """``(params, model_state, batch, key) -> (loss, (model_state, aux))`` whatever the declared form."""
        fn, stateful, aux = self.fn, self.has_model_state, self.has_aux
        if stateful:
            if aux:
                return fn
            return lambda p, ms, b, k: (lambda out: (out[0], (out[1], {})))(fn(p, ms, b, k))
        if aux:
            return lambda p, ms, b, k: (lambda out: (out[0], (ms, out[1])))(fn(p, b))
        return lambda p, ms, b, k: (fn(p, b), (ms, {}))

    def check_data(self, data: Any) -> None:
        """The data's values, where the loss knows what they may be (a function with a ``check_data(data)`` method,
        such as :func:`asgd_jax.classification_loss`'s, whose labels must be classes of the model): a ``ConfigError``
        naming what is wrong, before anything compiles. A plain function checks nothing here."""
        hook = getattr(self.fn, "check_data", None)
        if callable(hook):
            hook(data)

    def check(self, params: Any, model_state: Any, batch: Any) -> None:
        """Traces the loss once on a minibatch's shapes (no compilation) and raises a ``ConfigError`` that names the
        declared form when what it returns does not fit it."""
        key = jax.eval_shape(lambda: jax.random.key(0))  # abstract: nothing is placed on a device
        try:
            out = jax.eval_shape(
                (lambda p, ms, b, k: self.fn(p, ms, b, k))
                if self.has_model_state
                else (lambda p, ms, b, k: self.fn(p, b)),
                params,
                model_state,
                batch,
                key,
            )
        except (TypeError, ValueError) as e:
            if isinstance(e, TypeError) and _is_call_error(e):
                raise errors.ConfigError(f"the loss does not take the declared form {self.form}: {e}") from None
            raise errors.ConfigError(
                f"the loss fails on the shapes it is given: the weights are {_shapes(params)} and a minibatch is "
                f"{_shapes(batch)} ({type(e).__name__}: {str(e).splitlines()[0]}). Make the data's shapes fit the "
                "weights (the model's input shape, the label's shape)."
            ) from None
        loss, rest = (out, None) if not (self.has_model_state or self.has_aux) else _pair(out, self.form)
        problem = None
        if jnp.shape(loss) != () or not jnp.issubdtype(loss.dtype, jnp.floating):
            problem = f"its loss is {loss.dtype}{list(jnp.shape(loss))}, not a float scalar"
        elif self.has_model_state:
            new_state, aux = _pair(rest, self.form) if self.has_aux else (rest, {})
            expected: Any = jax.tree.structure(model_state)  # (PyTreeDef's stub lacks __ne__)
            if jax.tree.structure(new_state) != expected:
                problem = (
                    f"its new model state has the structure {jax.tree.structure(new_state)}, the model state "
                    f"{jax.tree.structure(model_state)}"
                )
            elif self.has_aux and not _scalar_dict(aux):
                problem = f"its aux is {aux!r}, not a dict of scalars"
        elif self.has_aux and not _scalar_dict(rest):
            problem = f"its aux is {rest!r}, not a dict of scalars"
        if problem:
            raise errors.ConfigError(
                f"the loss does not return what its declared form {self.form} says: {problem}. Declare the form it "
                "has (asgd_jax.Loss(fn, has_model_state=..., has_aux=...), or has_aux= in simulate)."
            )


def _is_call_error(e: TypeError) -> bool:
    """Whether a ``TypeError`` is about how the loss is called (its arguments), not about the arrays it computes on."""
    text = str(e)
    return "positional argument" in text or "keyword argument" in text or "not callable" in text


def _shapes(tree: Any) -> str:
    """A pytree's leaves as ``dtype[shape]``, keyed by path: what a shape error message names."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    described = [
        f"{jax.tree_util.keystr(path) or 'array'}: {jnp.result_type(x)}{list(jnp.shape(x))}" for path, x in leaves
    ]
    return "{" + ", ".join(described[:8]) + (", ..." if len(described) > 8 else "") + "}"


def _pair(out: Any, form: str) -> tuple[Any, Any]:
    if not (isinstance(out, tuple | list) and len(out) == 2):
        raise errors.ConfigError(f"the loss returned {out!r}, but its declared form {form} returns a pair.")
    return out[0], out[1]


def _scalar_dict(aux: Any) -> bool:
    return isinstance(aux, dict) and all(jnp.shape(v) == () for v in aux.values())


def as_loss(loss_fn: Callable | Loss, *, has_model_state: bool, has_aux: bool = False) -> Loss:
    """``loss_fn`` as a :class:`Loss`: a ``Loss`` keeps the form it declares (which must agree with whether the caller
    passed a model state), a plain function gets the form given here."""
    if isinstance(loss_fn, Loss):
        if loss_fn.has_model_state != has_model_state:
            fix = "pass model_state=<the model's initial state>" if loss_fn.has_model_state else "drop model_state"
            raise errors.ConfigError(
                f"the loss declares has_model_state={loss_fn.has_model_state} ({loss_fn.form}) but model_state "
                f"{'was not' if loss_fn.has_model_state else 'was'} given: {fix}."
            )
        return loss_fn
    return Loss(loss_fn, has_model_state=has_model_state, has_aux=has_aux)
