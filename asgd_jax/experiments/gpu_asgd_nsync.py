"""GPU A-SGD's questions: clients in {1, 2, 4, 8, 16, 32} x n_sync in {1, 10, 100, 300, 900}, cold vs warm start
(the full form; the quick form runs clients {1, 4, 16} x n_sync {1, 4, 16}: on mnist1d's 4,000 examples a client's
shard is a few hundred examples, so 100 local minibatches would be several passes over it).

Clients run Downpour-style: n_sync local SGD steps from the fetched weights, then push the parameter delta, which the
server adds (push="delta", server learning rate 1). The warm start is single-worker SGD for `warm_epochs` from the
shared initial weights. Training error is smoothed over a sliding window of minibatches (the paper: 400) and plotted
against server updates, virtual wall-clock time and effective epochs (each exchange costs `comm_time` = 2
minibatches, which is what n_sync amortises).

Command:   asgd-jax run gpu_asgd_nsync --quick --out results/gpu_asgd_nsync     (~2 minutes on 2 CPU cores: 18
           compiled programs, most of it compilation)
Full form: asgd-jax run gpu_asgd_nsync --out results/gpu_asgd_nsync_full        (CIFAR-10 with the cuda-convnet style
           network, the whole grid, 400-minibatch window; a GPU, after `asgd-jax data prepare cifar10`)
Expected:  staleness is M x n_sync minibatches, and past a point training destabilises (the paper's n_sync = 900
           artefacts): frequent exchanges reach lower error per epoch, large n_sync costs less time per epoch; a warm
           start helps most where a cold start with many clients struggles early on.
"""

from asgd_jax.experiments._dcasgd import variant
from asgd_jax.plan import Plan
from asgd_jax.studies import Arm, Settings, Study, Table

COMM_TIME = 2.0


def arms(s: Settings, quick: bool) -> list[Arm]:
    clients = (1, 4, 16) if quick else (1, 2, 4, 8, 16, 32)
    n_syncs = (1, 4, 16) if quick else (1, 10, 100, 300, 900)
    out = []
    for start in ("cold", "warm"):
        for m in clients:
            for n_sync in n_syncs:
                out.append(
                    Arm(
                        {"clients": m, "n_sync": n_sync, "start": start},
                        Plan(s.cluster(m, comm_time=COMM_TIME), n_sync=n_sync, push="delta", local_lr=s.learning_rate),
                        server_lr=1.0,
                        warm=start == "warm",
                        variants=(variant("A-SGD"),),
                        series=f"{start}, n_sync={n_sync}",
                    )
                )
    return out


STUDY = Study(
    name="gpu_asgd_nsync",
    title="GPU A-SGD: final test error vs clients, by n_sync and start",
    reproduces=__doc__,
    quick=Settings(seeds=(0,), epochs=10.0, learning_rate=0.05, schedule="constant", window=100, warm_epochs=2.0),
    full=Settings(
        dataset="tfds:cifar10",
        model="convnet",
        model_options={"width": 0.25, "stem_stride": 1},
        seeds=(0, 1, 2),
        epochs=40.0,
        batch_size=128,
        learning_rate=0.01,
        schedule="constant",
        window=400,
        warm_epochs=4.0,
    ),
    arms=arms,
    table=Table(rows="clients", curves_x=("update", "time", "epoch")),
)
