"""DC-ASGD's knobs (Zheng et al. 2017), shared by the studies that run it: the algorithms of its Table 1, lambda_0 of
DC-ASGD-c and -a, MeanSquare's decay, and the variants that run SGD, ASGD, SSGD, DC-ASGD-c and -a as one compiled
program (the ``dc_asgd`` rule with lambda_0 and the adaptive flag traced). The study language itself knows nothing
of them."""

from __future__ import annotations

import dataclasses
from typing import Any

from asgd_jax import errors, rules
from asgd_jax.studies import Settings, Variant

ALGORITHMS = {
    "sgd": "SGD",
    "asgd": "ASGD",
    "ssgd": "SSGD",
    "dc_asgd_c": "DC-ASGD-c",
    "dc_asgd_a": "DC-ASGD-a",
}
"""The algorithms of DC-ASGD's Table 1 (``asgd-jax ablate --algorithms``) and their labels."""


@dataclasses.dataclass(frozen=True)
class DCSettings(Settings):
    """A DC-ASGD study's settings: the study's :class:`~asgd_jax.studies.Settings` and DC-ASGD's own numbers.

    Attributes:
      algorithms: which of :data:`ALGORITHMS` run (``asgd-jax ablate --algorithms``).
      lam_c, lam_a: DC-ASGD-c's and -a's lambda_0 (the paper: 0.04 and 2).
      mean_square_decay: DC-ASGD-a's m (the paper: 0.95).
    """

    algorithms: tuple[str, ...] = tuple(ALGORITHMS)
    lam_c: float = 0.04
    lam_a: float = 2.0
    mean_square_decay: float = 0.95

    def __post_init__(self):
        super().__post_init__()
        unknown = [a for a in self.algorithms if a not in ALGORITHMS]
        errors.require(
            bool(self.algorithms) and not unknown,
            "algorithms",
            list(self.algorithms),
            f"choose from {', '.join(ALGORITHMS)}",
        )
        # lam_c, lam_a and mean_square_decay are checked by the rule itself.
        rules.get("dc_asgd_c", 0.1, lam=self.lam_c, momentum=self.momentum)
        rules.get("dc_asgd_a", 0.1, lam=self.lam_a, mean_square_decay=self.mean_square_decay)

    @classmethod
    def of(cls, settings: Settings, **changes: Any) -> DCSettings:
        """``settings`` (a plain setup such as :data:`asgd_jax.studies.DCASGD_CIFAR10`) with DC-ASGD's numbers (its
        own, if it has them)."""
        if isinstance(settings, cls) and not changes:
            return settings
        fields = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}
        return cls(**{**fields, **changes})


def variant(label: str, lam: float = 0.0, adaptive: bool = False, **kwargs: Any) -> Variant:
    """A ``dc_asgd`` variant: SGD, ASGD and SSGD are lambda_0 = 0; variants of one arm share its program."""
    return Variant(label, rule="dc_asgd", hp={"lam": lam, "adaptive": float(adaptive)}, **kwargs)


def options(s: Settings) -> dict[str, Any]:
    """The static options of an arm of DC-ASGD variants under ``s``: its MeanSquare decay."""
    return {"mean_square_decay": getattr(s, "mean_square_decay", 0.95)}
