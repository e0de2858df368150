"""The small least-squares problem the trainer, its life-cycle and the Ray tests share."""

import jax.numpy as jnp
import numpy as np

N, DIM = 96, 4
_rng = np.random.default_rng(0)
X = _rng.normal(size=(N, DIM)).astype(np.float32)
DATA = {"x": X, "y": (X @ _rng.normal(size=DIM)).astype(np.float32)}
W0 = np.zeros(DIM, np.float32)


def lsq_loss(w, batch):
    return 0.5 * jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
