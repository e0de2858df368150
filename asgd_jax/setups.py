"""A training setup: the one description of "the paper's run" that the studies and the trainer share.

A :class:`Setup` holds what a paper's recipe fixes besides the update rule and the cluster: the data and the model
(with its options), the minibatch, the learning-rate schedule (constant, step or cosine decay, with a linear warm-up;
positions as fractions of the run, in epochs or in updates), momentum, weight decay, augmentation and how the held-out
split is evaluated. The simulator's studies (:class:`asgd_jax.studies.Settings` is a ``Setup`` plus the study's grid)
and ``asgd-jax train`` (flags, or a TOML ``--config``; ``asgd_jax/configs/`` ships the papers' setups) build their
schedule, rule, loss and evaluation from it through the same methods, so a study's full form and the training script
run the same numbers.

Example:
  >>> from asgd_jax.setups import Setup
  >>> setup = Setup(learning_rate=0.5, schedule="step", decay_at=(80, 120), unit="epoch", warmup=2, momentum=0.9)
  >>> lr = setup.learning_rate_schedule(num_updates=1600, updates_per_epoch=10)
  >>> [round(float(lr(t)), 4) for t in (0, 19, 20, 799, 800, 1200)]
  [0.025, 0.5, 0.5, 0.5, 0.05, 0.005]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import optax

from asgd_jax import errors, rules, schedules

__all__ = ["DTYPES", "SCHEDULES", "UNITS", "Schedule", "Setup", "make_rule"]

SCHEDULES = ("constant", "step", "cosine")
UNITS = ("fraction", "epoch", "update")
DTYPES = ("float32", "bfloat16")


def make_rule(
    name: str, learning_rate: Any, *, momentum: Any = None, weight_decay: Any = 0.0, **hyperparameters: Any
) -> Any:
    """The registered rule ``name`` with a setup's momentum (where the rule takes one; else its own default) and
    weight decay chained before it: how a study's arms and ``asgd-jax train`` both build a rule."""
    if momentum is not None and "momentum" in rules.defaults(name):
        hyperparameters.setdefault("momentum", momentum)
    made = rules.get(name, learning_rate, **hyperparameters)
    return rules.weight_decayed(made, weight_decay) if weight_decay else made


class Schedule(NamedTuple):
    """A learning-rate schedule's shape in updates (what :meth:`Setup.schedule_in_updates` makes): hashable, so a study
    arm's rule function stays a value; :meth:`build` puts in the peak learning rate, traced or not."""

    kind: str  # "constant", "step" or "cosine"
    boundaries: tuple[int, ...]  # the step decays, in updates
    factor: float  # the step factor, or the cosine's final fraction
    warmup: int  # updates of linear warm-up (0: none)
    num_updates: int  # the run's length (the cosine's)

    def build(self, learning_rate: Any) -> optax.Schedule:
        if self.kind == "step":
            main = schedules.piecewise(learning_rate, self.boundaries, self.factor)
        elif self.kind == "cosine":
            main = schedules.cosine(learning_rate, self.num_updates, self.factor)
        else:
            main = schedules.constant(learning_rate)
        return schedules.warmed_up(main, self.warmup) if self.warmup else main


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a training recipe fixes besides the rule and the cluster, validated when made.

    Attributes:
      dataset, data_dir: the data by name (``mnist1d``, ``digits``, ``tfds:<name>``) and the TFDS folder.
      model, model_options: the model by name and the options of :func:`asgd_jax.models.get` (``width=``, ...).
      dtype: ``"float32"``, or ``"bfloat16"``: the model computes in bf16 while weights, gradients and the server's
        state stay float32 (as the papers' GPU ports do).
      batch_size: the minibatch per worker.
      learning_rate: the initial (peak) learning rate.
      schedule: ``"constant"``, ``"step"`` (times ``decay_factor`` at each of ``decay_at``, DC-ASGD's) or
        ``"cosine"`` (to ``decay_factor`` times the peak at the end of the run).
      decay_at: the step schedule's positions, in ``unit``.
      decay_factor: the step schedule's factor, or the cosine schedule's final fraction.
      warmup: a linear warm-up from 0 to the peak over this many ``unit`` (0: none).
      unit: ``"fraction"`` of the run, ``"epoch"`` or ``"update"``: what ``decay_at`` and ``warmup`` count.
      momentum: the rule's momentum (``None``: the rule's own default).
      weight_decay: L2 weight decay: the rule is applied to ``g + weight_decay * w`` (the server's current weights,
        chained before the rule; DC-ASGD then compensates the regularised gradient).
      augment: a random crop and a horizontal flip of every training minibatch, fitted to the dataset
        (:func:`asgd_jax.preprocess.augmentation`: padding an eighth of the image's side, no flip of digits or
        characters; refused for inputs that are not images).
      eval_crop, eval_multi_crop: evaluate on the central ``eval_crop`` window, or average the ten crops of that size
        (GPU A-SGD's multi-crop testing).
    """

    dataset: str = "mnist1d"
    data_dir: str | None = None
    model: str = "mlp"
    model_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    dtype: str = "float32"
    batch_size: int = 32
    learning_rate: float = 0.5
    schedule: str = "step"
    decay_at: tuple[float, ...] = (0.5, 0.75)
    decay_factor: float = 0.1
    warmup: float = 0.0
    unit: str = "fraction"
    momentum: float | None = None
    weight_decay: float = 0.0
    augment: bool = False
    eval_crop: int | None = None
    eval_multi_crop: bool = False

    def __post_init__(self):
        errors.require(isinstance(self.dataset, str), "dataset", self.dataset, "give a dataset name")
        errors.require(isinstance(self.model, str), "model", self.model, "give a model name")
        errors.require(
            isinstance(self.model_options, Mapping), "model_options", self.model_options, "give a table of options"
        )
        from asgd_jax import models

        if self.model in models.names():  # (an unknown name is refused where the model is built, naming the known)
            models.check_options(self.model, self.model_options)
        errors.choice("dtype", self.dtype, DTYPES, "--dtype")
        errors.positive_int("batch_size", self.batch_size, "--batch-size")
        errors.finite_number("learning_rate", self.learning_rate, lowest=0.0, flag="--lr")
        errors.choice("schedule", self.schedule, SCHEDULES, "--schedule")
        errors.choice("unit", self.unit, UNITS, "--unit")
        decay_at = tuple(self.decay_at) if isinstance(self.decay_at, list | tuple) else None
        errors.require(
            decay_at is not None
            and all(errors.is_int(v) or isinstance(v, float) for v in decay_at)
            and all(v > 0 and math.isfinite(v) for v in decay_at)
            and list(decay_at) == sorted(decay_at),
            "decay_at",
            self.decay_at,
            "give increasing positions > 0 (in --unit)",
            "--decay-at",
        )
        object.__setattr__(self, "decay_at", decay_at)
        if self.unit == "fraction":
            errors.require(max(decay_at, default=0) < 1, "decay_at", decay_at, "fractions of the run are < 1")
        errors.finite_number("decay_factor", self.decay_factor, lowest=0.0, flag="--decay-factor")
        errors.finite_number("warmup", self.warmup, lowest=0.0, flag="--warmup")
        if self.momentum is not None:
            errors.finite_number("momentum", self.momentum, lowest=0.0, flag="--momentum")
        errors.finite_number("weight_decay", self.weight_decay, lowest=0.0, flag="--weight-decay")
        errors.require(isinstance(self.augment, bool), "augment", self.augment, "use True or False", "--augment")
        errors.require(
            not (self.augment and self.dataset == "mnist1d"),
            "augment",
            self.augment,
            "augmentation needs images; mnist1d's inputs are 1-D signals [40]: drop --augment",
            "--augment",
        )
        if self.eval_crop is not None:
            errors.positive_int("eval_crop", self.eval_crop, "--eval-crop")
        errors.require(
            isinstance(self.eval_multi_crop, bool) and (self.eval_crop is not None or not self.eval_multi_crop),
            "eval_multi_crop",
            self.eval_multi_crop,
            "True needs eval_crop (--eval-crop N), the size of the ten crops",
            "--eval-multi-crop",
        )

    # -- what the engines are built from --------------------------------------------------------------------------

    def updates(self, position: float, num_updates: int, updates_per_epoch: float) -> int:
        """A position in ``unit`` as an update count of a run of ``num_updates``."""
        if self.unit == "fraction":
            return int(position * num_updates)
        return round(position * updates_per_epoch) if self.unit == "epoch" else int(position)

    def schedule_in_updates(self, num_updates: int, updates_per_epoch: float = 1.0) -> Schedule:
        """The schedule's shape for a run of ``num_updates`` (``updates_per_epoch`` converts epochs): a hashable
        value, the same for every learning rate."""
        at = tuple(sorted({self.updates(p, num_updates, updates_per_epoch) for p in self.decay_at}))
        warm = self.updates(self.warmup, num_updates, updates_per_epoch) if self.warmup else 0
        return Schedule(self.schedule, at if self.schedule == "step" else (), self.decay_factor, warm, num_updates)

    def learning_rate_schedule(
        self, num_updates: int, updates_per_epoch: float = 1.0, learning_rate: Any = None
    ) -> optax.Schedule:
        """The learning rate by update count (``learning_rate`` replaces the peak, and may be traced: a sweep tunes
        it). Its numbers are arguments of a compiled program (:mod:`asgd_jax.schedules`)."""
        lr = self.learning_rate if learning_rate is None else learning_rate
        return self.schedule_in_updates(num_updates, updates_per_epoch).build(lr)

    def rule(self, name: str, learning_rate: Any, **hyperparameters: Any) -> optax.GradientTransformationExtraArgs:
        """The registered rule ``name`` at ``learning_rate`` (a number or a schedule) with this setup's momentum (where
        the rule takes one) and weight decay."""
        return make_rule(name, learning_rate, momentum=self.momentum, weight_decay=self.weight_decay, **hyperparameters)

    def build_model(self, num_classes: int, input_shape: Any) -> Any:
        """The model, with its options and compute dtype."""
        from asgd_jax import models

        options = dict(self.model_options)
        if self.dtype != "float32":
            options["dtype"] = self.dtype
        return models.get(self.model, num_classes=num_classes, input_shape=input_shape, **options)

    def loss(self, model: Any) -> Any:
        """The training loss (with the augmentation that fits the dataset when the setup asks for it)."""
        from asgd_jax import models

        if not self.augment:
            return models.classification_loss(model)
        fitted = self.augmentation(model.input_shape)
        return models.classification_loss(model, augment=True, padding=fitted.padding, flip=fitted.flip)

    def augmentation(self, input_shape: tuple[int, ...]) -> Any:
        """The augmentation ``augment`` means on this setup's dataset (:func:`asgd_jax.preprocess.augmentation`);
        ``None`` without ``augment``."""
        from asgd_jax import preprocess

        return preprocess.augmentation(self.dataset, input_shape) if self.augment else None

    def evaluation(self, model: Any, test: Any) -> Any:
        """The held-out evaluation, with its crops (a crop larger than the images is refused here, before any
        compile)."""
        from asgd_jax import models

        if self.eval_crop is not None:
            side = min(model.input_shape[:2]) if len(model.input_shape) == 3 else 0
            errors.require(
                self.eval_crop <= side,
                "eval_crop",
                self.eval_crop,
                f"the images are {'x'.join(map(str, model.input_shape[:2]))}: use a crop of at most {side}"
                if side
                else f"crops need images; the inputs are {list(model.input_shape)}: drop --eval-crop",
                "--eval-crop",
            )

        return models.classification_eval(model, test, crop=self.eval_crop, multi_crop=self.eval_multi_crop)

    def setup_fields(self) -> dict[str, Any]:
        """This setup's own fields (not a subclass's), by name: what a config file or a study's form holds."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(Setup)}
