"""DC-ASGD Table 1, in shape: {SGD at M=1, ASGD, SSGD, DC-ASGD-c, DC-ASGD-a} x M in {4, 8}, final test error.

Command:   asgd-jax run dcasgd_table1 --quick --out results/dcasgd_table1     (~45 s on 2 CPU cores)
Full form: asgd-jax run dcasgd_table1 --out results/dcasgd_table1_full        (CIFAR-10 ResNet-20, 160 epochs, a GPU;
           needs `asgd-jax data prepare cifar10` first; the same setup as experiments/cifar10_resnet20.py)
Expected:  staleness costs ASGD accuracy as M grows; DC-ASGD-a recovers most of it (the paper: 8.57% vs ASGD's 10.26%
           at M = 8, sequential SGD 8.65%); SSGD pays for its M-times-larger effective batch at a fixed epoch budget.
"""

from asgd_jax.studies import DCASGD_CIFAR10, Arm, Settings, Study, Variant

ASYNC = (
    Variant("ASGD"),
    Variant("DC-ASGD-c", lam=0.04),
    Variant("DC-ASGD-a", lam=2.0, adaptive=True),
)


def arms(s: Settings, quick: bool) -> list[Arm]:
    out = [Arm({"M": 1}, workers=1, variants=(Variant("SGD"),))]
    for m in (4, 8):
        out.append(Arm({"M": m}, workers=m, variants=ASYNC))
        out.append(Arm({"M": m}, workers=m, mode="sync", variants=(Variant("SSGD"),)))
    return out


STUDY = Study(
    name="dcasgd_table1",
    title="DC-ASGD Table 1: final test error vs workers",
    reproduces=__doc__,
    quick=Settings(seeds=(0, 1, 2), epochs=15.0),
    full=DCASGD_CIFAR10,
    arms=arms,
    rows="M",
    columns="label",
    paper={
        1: {"SGD": 8.65},
        4: {"ASGD": 9.27, "SSGD": 9.17, "DC-ASGD-c": 8.67, "DC-ASGD-a": 8.19},
        8: {"ASGD": 10.26, "SSGD": 10.10, "DC-ASGD-c": 9.27, "DC-ASGD-a": 8.57},
    },
    paper_note="CIFAR-10, ResNet-20, 160 epochs (Zheng et al. 2017, Table 1)",
)
