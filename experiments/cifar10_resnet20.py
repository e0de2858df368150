"""DC-ASGD's CIFAR-10 setup (Zheng et al. 2017, Table 1), exactly as PAPERS.md section 1 states it.

ResNet-20, no data augmentation, 160 effective epochs, minibatch 128 per worker, learning rate 0.5 divided by 10 at
epochs 80 and 120, DC-ASGD-c lambda_0 = 0.04, DC-ASGD-a lambda_0 = 2 and m = 0.95, workers M in {1, 4, 8}, the data
re-partitioned randomly onto the workers every epoch, every run from the same initial weights with the same schedule.
SSGD averages M gradients per update (effective batch M x 128).

Run it for real on a GPU (prepare CIFAR-10 once, needs network):

    asgd-jax data prepare cifar10 --data-dir ~/tensorflow_datasets
    .venv/bin/python experiments/cifar10_resnet20.py --data-dir ~/tensorflow_datasets --out results/cifar10_resnet20

Expected: test error in the paper's range (SGD 8.65%; M=8: ASGD 10.26%, DC-ASGD-a 8.57%), with ASGD worse than SGD
and DC-ASGD-a closing most of the gap. Runtime: 5 seeds x 13 runs x 160 epochs of ResNet-20 is GPU work (hours on
one GPU with the sweep vmapping the seeds and algorithms of each M); it is not meant for a CPU.
"""

from __future__ import annotations

import argparse
import dataclasses

from asgd_jax import ablation

CONFIG = ablation.AblationConfig(
    dataset="tfds:cifar10",
    model="resnet20",
    workers=(1, 4, 8),
    algorithms=("sgd", "asgd", "ssgd", "dc_asgd_c", "dc_asgd_a"),
    seeds=(0, 1, 2, 3, 4),
    epochs=160.0,
    batch_size=128,
    learning_rate=0.5,  # divided by 10 at 50% and 75% of the updates: epochs 80 and 120 of 160
    lam_c=0.04,
    lam_a=2.0,
    mean_square_decay=0.95,
    momentum=None,  # the paper's reported numbers use no momentum
    window=400,
    evals=40,
)


def run(config: ablation.AblationConfig = CONFIG, out: str = "results/cifar10_resnet20", progress: bool = True):
    """Runs the configuration and writes results.json/csv, table.md and curves.png into ``out``."""
    result = ablation.run(config, progress=progress)
    ablation.save(result, out)
    print(ablation.format_table(result))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=None, help="where CIFAR-10 was prepared")
    parser.add_argument("--out", default="results/cifar10_resnet20")
    parser.add_argument("--seeds", type=int, default=len(CONFIG.seeds))
    args = parser.parse_args()
    config = dataclasses.replace(CONFIG, data_dir=args.data_dir, seeds=tuple(range(args.seeds)))
    run(config, args.out)


if __name__ == "__main__":
    main()
