"""Stragglers and mixed-speed clusters at M = 8: which rule degrades least? Clusters: uniform; one worker 4x slower;
half the workers at half speed; random stragglers (10% of minibatches 10x slower). Rules: ASGD, DC-ASGD-a,
staleness-aware, delay-adaptive, and SSGD as the synchronous reference.

Command:   asgd-jax run heterogeneous_workers --quick --out results/heterogeneous_workers    (~2 minutes on 2 cores)
Full form: asgd-jax run heterogeneous_workers --out results/heterogeneous_workers_full       (5 seeds, 40 epochs)
Expected:  a slow worker's pushes are very stale; ASGD suffers most from it, DC-ASGD-a and the staleness-aware rule
           damp it; SSGD's accuracy does not depend on speeds (only its wall-clock time does).
"""

from asgd_jax.experiments._dcasgd import variant
from asgd_jax.plan import Plan
from asgd_jax.studies import Arm, Settings, Study, Table, Variant

M = 8
CLUSTERS = {
    "uniform": {},
    "one 4x straggler": {"speeds": (0.25,) + (1.0,) * (M - 1)},
    "half at half speed": {"speeds": (0.5,) * (M // 2) + (1.0,) * (M - M // 2)},
    "random stragglers": {"straggler_prob": 0.1, "straggler_slowdown": 10.0},
}


def arms(s: Settings, quick: bool) -> list[Arm]:
    out = []
    for cluster, kwargs in CLUSTERS.items():
        c, plan = {"cluster": cluster}, Plan(s.cluster(M, **kwargs))
        out.append(Arm(c, plan, variants=(variant("ASGD"), variant("DC-ASGD-a", lam=2.0, adaptive=True))))
        out.append(Arm(c, plan, variants=(Variant("staleness-aware", rule="staleness_aware"),)))
        out.append(Arm(c, plan, variants=(Variant("delay-adaptive", rule="delay_adaptive"),)))
        out.append(Arm(c, plan.replace(mode="sync"), variants=(variant("SSGD"),)))
    return out


STUDY = Study(
    name="heterogeneous_workers",
    title="Final test error on heterogeneous clusters, M = 8",
    reproduces=__doc__,
    quick=Settings(seeds=(0, 1), epochs=10.0),
    full=Settings(seeds=(0, 1, 2, 3, 4), epochs=40.0, evals=20),
    arms=arms,
    table=Table(rows="cluster"),
)
