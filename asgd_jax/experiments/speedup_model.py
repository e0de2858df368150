"""Predicted speed-up from the simulator's virtual clock: time to reach a target training error vs number of clients
and n_sync (1 and 4), under a compute/communication cost model (a minibatch costs 1 on average, exponentially
distributed; an exchange costs `comm_time`). GPU A-SGD's reference point is a 3.2x speed-up with 8 GPUs on
ImageNet. Also SSGD with random stragglers (10% of minibatches 10x slower) against ASGD on the same cluster.

Command:   asgd-jax run speedup_model --quick --out results/speedup_model     (~1.5 minutes on 2 CPU cores)
Full form: asgd-jax run speedup_model --out results/speedup_model_full        (clients up to 32, 3 seeds)
Expected:  speed-up grows with clients but sub-linearly (staleness costs progress per update); larger n_sync helps when
           communication is expensive; SSGD waits for the slowest worker every step and falls behind ASGD.
"""

from asgd_jax.experiments._dcasgd import variant
from asgd_jax.plan import Plan
from asgd_jax.studies import Arm, Paper, Settings, Study, Table

COMM_TIME = 1.0
STRAGGLERS = {"straggler_prob": 0.1, "straggler_slowdown": 10.0}


def arms(s: Settings, quick: bool) -> list[Arm]:
    clients = (1, 2, 4, 8) if quick else (1, 2, 4, 8, 16, 32)
    out = []
    for n_sync in (1, 4):
        for m in clients:
            out.append(
                Arm(
                    {"clients": m, "n_sync": n_sync},
                    Plan(s.cluster(m, comm_time=COMM_TIME), n_sync=n_sync, push="delta", local_lr=s.learning_rate),
                    server_lr=1.0,
                    variants=(variant("ASGD"),),
                    series=f"ASGD, n_sync={n_sync}",
                )
            )
    for m in clients[1:]:
        for mode in ("async", "sync"):
            out.append(
                Arm(
                    {"clients": m},
                    Plan(s.cluster(m, comm_time=COMM_TIME, **STRAGGLERS), mode=mode),
                    variants=(variant("SSGD" if mode == "sync" else "ASGD"),),
                    series="{label}, stragglers",
                )
            )
    return out


STUDY = Study(
    name="speedup_model",
    title="Speed-up in virtual time to a target training error vs clients",
    reproduces=__doc__,
    quick=Settings(seeds=(0, 1), epochs=10.0, learning_rate=0.05, schedule="constant", target_error=0.5),
    full=Settings(seeds=(0, 1, 2), epochs=30.0, learning_rate=0.05, schedule="constant", target_error=0.45),
    arms=arms,
    table=Table(rows="clients", metric="speedup", baseline={"clients": 1, "n_sync": 1}, curves_x=("time",)),
    paper=Paper(
        numbers={8: {"ASGD (GPU A-SGD, ImageNet, 8 GPUs)": 3.2}},
        note="GPU A-SGD (Paine et al. 2013): 10.6 -> 3.3 days with 8 GPUs",
    ),
)
