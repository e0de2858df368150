"""Image preprocessing as pure, keyed JAX functions: normalisation, training augmentation, crop evaluation.

All functions take channels-last batches ``[n, h, w, c]``. Augmentation is off by default everywhere (DC-ASGD's
CIFAR-10 runs used none); GPU A-SGD evaluated with multi-crop testing: the logits of the four corner crops, the centre
crop and their horizontal flips, averaged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from asgd_jax import errors

__all__ = [
    "NOT_MIRRORED",
    "Augmentation",
    "augmentation",
    "center_crop",
    "multi_crop_logits",
    "normalize",
    "random_crop_flip",
    "ten_crops",
]

NOT_MIRRORED = frozenset({"digits", "mnist", "emnist", "kmnist", "svhn_cropped", "mnist_corrupted", "binarized_mnist"})
"""Datasets whose images change class (or stop being one) when mirrored: digits and characters. Augmentation never
flips them."""


class Augmentation(NamedTuple):
    """A training augmentation fitted to a dataset: a random crop after zero-padding by ``padding``, and a horizontal
    flip of half the images where the dataset is mirror-symmetric (``flip``)."""

    padding: int
    flip: bool
    why: str

    def describe(self) -> str:
        flips = "and flips" if self.flip else f"without flips ({self.why})"
        return f"a random crop after padding by {self.padding} pixel(s) {flips}"


def augmentation(dataset: str, input_shape: tuple[int, ...]) -> Augmentation:
    """The augmentation that fits ``dataset``'s images of ``input_shape`` (``[h, w, c]``): the padding an eighth of
    the image's side (CIFAR-10's 4 at 32 pixels; 1 on 8x8 digits), no flip for :data:`NOT_MIRRORED` datasets.

    Raises:
      ConfigError: the inputs are not images (``[h, w, c]``), e.g. ``mnist1d``'s signals.

    Example:
      >>> from asgd_jax import preprocess
      >>> preprocess.augmentation("digits", (8, 8, 1)).describe()
      'a random crop after padding by 1 pixel(s) without flips (digits are not mirror-symmetric)'
      >>> preprocess.augmentation("tfds:cifar10", (32, 32, 3))[:2]
      (4, True)
    """
    shape = tuple(input_shape)
    errors.require(
        len(shape) == 3,
        "augment",
        True,
        f"augmentation needs images [height, width, channels]; {dataset}'s inputs are {list(shape)}: drop --augment",
        "--augment",
    )
    base = dataset.removeprefix("tfds:").split(":")[0].split("/")[0]
    padding = max(1, round(min(shape[:2]) / 8))
    if base in NOT_MIRRORED:
        return Augmentation(
            padding,
            False,
            f"{base} are not mirror-symmetric" if base == "digits" else f"{base}'s images are not mirror-symmetric",
        )
    return Augmentation(padding, True, "")


def normalize(x: np.ndarray | jax.Array, mean, std):
    """``(x - mean) / std`` with per-channel statistics (broadcast over the last axis)."""
    return (x - mean) / std


def random_crop_flip(key: jax.Array, x: jax.Array, padding: int = 4, flip: bool = True) -> jax.Array:
    """Zero-pads by ``padding``, crops back to the input size at a random offset and flips half the images.

    One offset and flip per image, drawn from ``key``; fixed shapes, so it jits once.

    Example:
      >>> import jax, jax.numpy as jnp, asgd_jax
      >>> x = jnp.arange(2 * 4 * 4 * 1.0).reshape(2, 4, 4, 1)
      >>> asgd_jax.preprocess.random_crop_flip(jax.random.key(0), x, padding=1).shape
      (2, 4, 4, 1)
    """
    n, h, w, _ = x.shape
    k_off, k_flip = jax.random.split(key)
    padded = jnp.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
    offsets = jax.random.randint(k_off, (n, 2), 0, 2 * padding + 1)
    crop = lambda img, off: jax.lax.dynamic_slice(img, (off[0], off[1], 0), (h, w, x.shape[-1]))
    out = jax.vmap(crop)(padded, offsets)
    if flip:
        flips = jax.random.bernoulli(k_flip, 0.5, (n,))
        out = jnp.where(flips[:, None, None, None], out[:, :, ::-1, :], out)
    return out


def center_crop(x: jax.Array, size: int) -> jax.Array:
    """The central ``size x size`` window."""
    h, w = x.shape[1:3]
    _check_crop(size, h, w)
    top, left = (h - size) // 2, (w - size) // 2
    return x[:, top : top + size, left : left + size, :]


def ten_crops(x: jax.Array, size: int) -> jax.Array:
    """The four corner crops, the centre crop and their horizontal flips: ``[10, n, size, size, c]``."""
    h, w = x.shape[1:3]
    _check_crop(size, h, w)
    corners = [(0, 0), (0, w - size), (h - size, 0), (h - size, w - size)]
    crops = [x[:, top : top + size, left : left + size, :] for top, left in corners] + [center_crop(x, size)]
    return jnp.stack(crops + [c[:, :, ::-1, :] for c in crops])


def multi_crop_logits(apply: Callable[[jax.Array], jax.Array], x: jax.Array, size: int) -> jax.Array:
    """Averages ``apply(crop)`` over the ten crops of :func:`ten_crops` (multi-crop testing).

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> x = jnp.arange(16.0).reshape(1, 4, 4, 1)
      >>> asgd_jax.preprocess.multi_crop_logits(lambda c: c.mean(axis=(1, 2)), x, size=2)  # every pixel's weight
      Array([[7.5]], dtype=float32)
    """
    crops = ten_crops(x, size)
    return jax.lax.map(apply, crops).mean(axis=0)


def _check_crop(size: int, h: int, w: int) -> None:
    if not isinstance(size, int) or not 1 <= size <= min(h, w):
        raise errors.ConfigError(f"crop size={size!r} is invalid for {h}x{w} images: use an int in [1, {min(h, w)}].")
