#!/usr/bin/env bash
# The GPU check, one prepared script (under 10 minutes on one GPU): the simulator against the plain-JAX floor at the
# cnn, a sweep's runs x updates/s on one and on every GPU with the staleness leaderboard's full form in hours, and the
# trainer's scaling: 1, 2, 4 and 8 workers (one per GPU; ResNet-20 and the convnet at batch 128) beside one GPU's
# plain jitted step, the store's state on the host and on a GPU, with each store's ceiling in pushes/s against that
# step rate (GPU A-SGD's headline is 3.2x on 8 GPUs: the trainer can show it only where the ceiling allows it). Run from the repository root on the GPU machine:
#   bash experiments/benchmarks/gpu_check.sh 2>&1 | tee gpu_check.log
# It installs nothing: the environment needs asgd_jax and JAX's CUDA build (pip install -e . "jax[cuda12]").
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
$PY -c "import jax; print('jax', jax.__version__, jax.devices())"
echo "== simulator vs floor (cnn, W)"; timeout 150 $PY experiments/benchmarks/simulator_overhead.py --quick --only cnn W --scale 2
echo "== sweep throughput and the leaderboard's hours"; timeout 150 $PY experiments/benchmarks/sweep_throughput.py --quick
echo "== trainer scaling"; timeout 280 $PY experiments/benchmarks/trainer_throughput.py --quick \
  --models resnet20 convnet --batch 128 --workers 1 2 4 8 --store-devices cpu gpu
