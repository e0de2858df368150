"""DC-ASGD Table 1, in shape: {SGD at M=1, ASGD, SSGD, DC-ASGD-c, DC-ASGD-a} x M in {4, 8}, final test error.

Command:   asgd-jax run dcasgd_table1 --quick --out results/dcasgd_table1     (~45 s on 2 CPU cores)
Full form: asgd-jax run dcasgd_table1 --out results/dcasgd_table1_full        (CIFAR-10 ResNet-20, 160 epochs, 5
           seeds, the paper's setup: hours on a GPU; needs `asgd-jax data prepare cifar10` first)
Ablation:  asgd-jax ablate [--quick] [--workers 1 4 8 16] [--algorithms ...] ...  (this study's `ablate` forms: the
           mnist1d MLP, 40 effective epochs and 5 seeds, or 15 and 3 with --quick; what `make demo` runs)
Expected:  staleness costs ASGD accuracy as M grows; DC-ASGD-a recovers most of it (the paper: 8.57% vs ASGD's 10.26%
           at M = 8, sequential SGD 8.65%); SSGD pays for its M-times-larger effective batch at a fixed epoch budget.
"""

from asgd_jax.experiments._dcasgd import ALGORITHMS, DCSettings, options, variant
from asgd_jax.plan import Plan
from asgd_jax.studies import DCASGD_CIFAR10, Arm, Paper, Study, Table, Variant


def _variant(name: str, s: DCSettings) -> Variant:
    label = ALGORITHMS[name]
    if name == "dc_asgd_c":
        return variant(label, lam=s.lam_c)
    if name == "dc_asgd_a":
        return variant(label, lam=s.lam_a, adaptive=True)
    return variant(label)  # SGD, ASGD and SSGD: lambda 0


def arms(s: DCSettings, quick: bool) -> list[Arm]:
    """Per worker count: SGD alone at M = 1; otherwise one asynchronous arm (ASGD, DC-ASGD-c, -a) and SSGD."""
    s = DCSettings.of(s)  # a plain Settings gets DC-ASGD's numbers at the paper's values
    out, dc = [], options(s)
    for m in s.workers:
        if m == 1:
            if "sgd" in s.algorithms:
                out.append(Arm({"M": 1}, Plan(s.cluster(1)), variants=(_variant("sgd", s),), rule_options=dc))
            continue
        asynchronous = tuple(_variant(a, s) for a in ("asgd", "dc_asgd_c", "dc_asgd_a") if a in s.algorithms)
        if asynchronous:
            out.append(Arm({"M": m}, Plan(s.cluster(m)), variants=asynchronous, rule_options=dc))
        if "ssgd" in s.algorithms:
            out.append(Arm({"M": m}, Plan(s.cluster(m), mode="sync"), variants=(_variant("ssgd", s),), rule_options=dc))
    return out


ABLATE = DCSettings(seeds=(0, 1, 2, 3, 4), epochs=40.0, evals=20, window=400)

STUDY = Study(
    name="dcasgd_table1",
    title="DC-ASGD Table 1: final test error vs workers",
    reproduces=__doc__,
    quick=DCSettings(seeds=(0, 1, 2), epochs=15.0, workers=(1, 4, 8)),
    full=DCSettings.of(DCASGD_CIFAR10),
    forms={"ablate": ABLATE, "ablate-quick": DCSettings(seeds=(0, 1, 2), epochs=15.0, evals=20, window=100)},
    arms=arms,
    table=Table(rows="M", column_order=tuple(ALGORITHMS.values())),
    paper=Paper(
        numbers={
            1: {"SGD": 8.65},
            4: {"ASGD": 9.27, "SSGD": 9.17, "DC-ASGD-c": 8.67, "DC-ASGD-a": 8.19},
            8: {"ASGD": 10.26, "SSGD": 10.10, "DC-ASGD-c": 9.27, "DC-ASGD-a": 8.57},
        },
        note="CIFAR-10, ResNet-20, 160 epochs (Zheng et al. 2017, Table 1)",
    ),
)
