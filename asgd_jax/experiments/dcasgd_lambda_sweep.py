"""DC-ASGD's lambda: DC-ASGD-a at M = 8 with lambda_0 in {0, 0.5, 1, 2, 4} (the supplement's sweep) and DC-ASGD-c with
constant lambda in {0, 0.01, 0.04, 0.1, 0.4}; all ten settings x seeds are one compiled sweep.

Command:   asgd-jax run dcasgd_lambda_sweep --quick --out results/dcasgd_lambda_sweep     (~30 s on 2 CPU cores)
Full form: asgd-jax run dcasgd_lambda_sweep --out results/dcasgd_lambda_sweep_full        (CIFAR-10 ResNet-20, a GPU)
Expected:  lambda = 0 is ASGD; a moderate lambda (the paper: 0.5-2 for -a) helps; too large a lambda adds variance
           and hurts, too small makes the correction vanish.
"""

from asgd_jax.experiments._dcasgd import DCSettings, options, variant
from asgd_jax.plan import Plan
from asgd_jax.studies import DCASGD_CIFAR10, Arm, Study, Table

LAMBDA_A = (0.0, 0.5, 1.0, 2.0, 4.0)
LAMBDA_C = (0.0, 0.01, 0.04, 0.1, 0.4)


def arms(s: DCSettings, quick: bool) -> list[Arm]:
    s = DCSettings.of(s)  # a plain Settings gets DC-ASGD's numbers at the paper's values
    variants = tuple(variant("DC-ASGD-a", lam=x, adaptive=True, coords={"lambda": x}) for x in LAMBDA_A)
    variants += tuple(variant("DC-ASGD-c", lam=x, coords={"lambda": x}) for x in LAMBDA_C)
    return [Arm({"M": 8}, Plan(s.cluster(8)), variants=variants, rule_options=options(s))]


STUDY = Study(
    name="dcasgd_lambda_sweep",
    title="DC-ASGD: final test error vs lambda_0 at M = 8",
    reproduces=__doc__,
    quick=DCSettings(seeds=(0, 1, 2), epochs=15.0),
    full=DCSettings.of(DCASGD_CIFAR10),
    arms=arms,
    table=Table(rows="lambda"),
)
