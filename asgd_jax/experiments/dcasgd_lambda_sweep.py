"""DC-ASGD's lambda: DC-ASGD-a at M = 8 with lambda_0 in {0, 0.5, 1, 2, 4} (the supplement's sweep) and DC-ASGD-c with
constant lambda in {0, 0.01, 0.04, 0.1, 0.4}; all ten settings x seeds are one compiled sweep.

Command:   asgd-jax run dcasgd_lambda_sweep --quick --out results/dcasgd_lambda_sweep     (~30 s on 2 CPU cores)
Full form: asgd-jax run dcasgd_lambda_sweep --out results/dcasgd_lambda_sweep_full        (CIFAR-10 ResNet-20, a GPU)
Expected:  lambda = 0 is ASGD; a moderate lambda (the paper: 0.5-2 for -a) helps; too large a lambda adds variance
           and hurts, too small makes the correction vanish.
"""

from asgd_jax.plan import Plan
from asgd_jax.studies import DCASGD_CIFAR10, Arm, Settings, Study, Variant

LAMBDA_A = (0.0, 0.5, 1.0, 2.0, 4.0)
LAMBDA_C = (0.0, 0.01, 0.04, 0.1, 0.4)


def arms(s: Settings, quick: bool) -> list[Arm]:
    variants = tuple(Variant("DC-ASGD-a", lam=x, adaptive=True, coords={"lambda": x}) for x in LAMBDA_A)
    variants += tuple(Variant("DC-ASGD-c", lam=x, coords={"lambda": x}) for x in LAMBDA_C)
    return [Arm({"M": 8}, Plan(s.cluster(8)), variants=variants)]


STUDY = Study(
    name="dcasgd_lambda_sweep",
    title="DC-ASGD: final test error vs lambda_0 at M = 8",
    reproduces=__doc__,
    quick=Settings(seeds=(0, 1, 2), epochs=15.0),
    full=DCASGD_CIFAR10,
    arms=arms,
    rows="lambda",
    columns="label",
)
