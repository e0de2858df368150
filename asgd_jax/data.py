"""Datasets by name: the embedded ones need no network.

``load("digits")`` is scikit-learn's bundled 8x8 digits (1,797 images); ``load("mnist1d")`` is MNIST-1D (Greydanus
2020) generated offline by its own ``make_dataset`` with the reference arguments (the download path is never taken).
Both come back as a :class:`Dataset` of float32 inputs with a channel axis and int32 labels, split and normalised the
same way on every machine.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np

__all__ = ["EMBEDDED", "Dataset", "load"]


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A classification dataset held in host memory.

    Attributes:
      name: the name it was loaded by.
      x_train, y_train: training inputs ``[n, *input_shape]`` (float32) and labels ``[n]`` (int32).
      x_test, y_test: held-out inputs and labels.
      num_classes: number of classes.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one input example, channels last."""
        return tuple(self.x_train.shape[1:])

    @property
    def train(self) -> dict[str, np.ndarray]:
        """The training split as the ``{"x", "y"}`` pytree the simulator takes."""
        return {"x": self.x_train, "y": self.y_train}

    @property
    def test(self) -> dict[str, np.ndarray]:
        """The test split as a ``{"x", "y"}`` pytree."""
        return {"x": self.x_test, "y": self.y_test}

    def __repr__(self) -> str:
        return (
            f"Dataset({self.name!r}, train={len(self.y_train)}, test={len(self.y_test)}, "
            f"input_shape={self.input_shape}, num_classes={self.num_classes})"
        )


def _split(x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int):
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = round(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def _standardise(x_train: np.ndarray, x_test: np.ndarray):
    # Per-channel statistics of the training split only, so the test split stays unseen.
    axes = tuple(range(x_train.ndim - 1))
    mean = x_train.mean(axis=axes, keepdims=True)
    std = x_train.std(axis=axes, keepdims=True) + 1e-8
    return ((x_train - mean) / std).astype(np.float32), ((x_test - mean) / std).astype(np.float32)


@functools.cache
def _digits(seed: int) -> Dataset:
    from sklearn.datasets import load_digits  # bundled with scikit-learn: no download

    bunch = load_digits()
    x = bunch.images.astype(np.float64)[..., None]  # [1797, 8, 8, 1]
    y = bunch.target.astype(np.int32)
    x_tr, y_tr, x_te, y_te = _split(x, y, test_fraction=0.2, seed=seed)
    x_tr, x_te = _standardise(x_tr, x_te)
    return Dataset("digits", x_tr, y_tr, x_te, y_te, num_classes=10)


@functools.cache
def _mnist1d(seed: int) -> Dataset:
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.seed = 42 + seed  # 42 is the reference dataset
    # make_dataset seeds NumPy's global generator; leave the caller's global state as it was.
    saved = np.random.get_state()  # noqa: NPY002 (mnist1d seeds the legacy global generator)
    try:
        raw = make_dataset(args)
    finally:
        np.random.set_state(saved)  # noqa: NPY002
    x_tr, x_te = _standardise(raw["x"][..., None], raw["x_test"][..., None])
    return Dataset(
        "mnist1d",
        x_tr,
        raw["y"].astype(np.int32),
        x_te,
        raw["y_test"].astype(np.int32),
        num_classes=10,
    )


EMBEDDED: dict[str, Callable[[int], Dataset]] = {"digits": _digits, "mnist1d": _mnist1d}
"""The datasets that ship with the install and need no network."""


def load(name: str, *, seed: int = 0) -> Dataset:
    """Loads a dataset by name.

    Args:
      name: ``"digits"`` (8x8 images, 1,438 train / 359 test) or ``"mnist1d"`` (length-40 signals, 4,000 / 1,000).
      seed: selects the train/test split (digits) or the generated sample (mnist1d); 0 is the reference.

    Returns:
      A :class:`Dataset`; repeated calls return the same cached object.

    Example:
      >>> import asgd_jax
      >>> ds = asgd_jax.data.load("digits")
      >>> ds.x_train.shape, ds.x_test.shape, ds.num_classes
      ((1438, 8, 8, 1), (359, 8, 8, 1), 10)
    """
    if name not in EMBEDDED:
        known = ", ".join(sorted(EMBEDDED))
        raise ValueError(f"Unknown dataset {name!r}. Known datasets: {known}.")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r} is invalid: use a non-negative int.")
    return EMBEDDED[name](seed)
