#!/usr/bin/env bash
# The GPU check, one prepared script (about 7 minutes on one H200, 5 with ONLY=trainer): the trainer's throughput with 1, 2, 4 and 8
# workers beside one GPU's plain jitted step (ResNet-20 and the convnet at batch 128), the store's state on the host
# and on the GPU, with each store's ceiling in pushes/s against that step rate (GPU A-SGD's headline is 3.2x on 8
# GPUs: the trainer can show it only where the ceiling allows it); then the simulator against the plain-JAX floor.
# Workers beyond the machine's GPUs share them (worker w on GPU w mod D): on one GPU, x2..x8 measure the store and the
# host's threads against one GPU's work. Run from the repository root on the GPU machine:
#   bash experiments/benchmarks/gpu_check.sh 2>&1 | tee gpu_check.log
# It installs nothing: the environment needs asgd_jax (or PYTHONPATH=.) and JAX's CUDA build; PYTHON=python3 to use
# another interpreter than .venv's.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c "import jax; print('jax', jax.__version__, jax.devices())"
echo "== trainer: ResNet-20"; timeout 220 $PY experiments/benchmarks/trainer_throughput.py --models resnet20 \
  --batch 128 --steps 300 --workers 1 2 4 8 --store-devices cpu gpu
echo "== trainer: convnet"; timeout 100 $PY experiments/benchmarks/trainer_throughput.py --models convnet \
  --batch 128 --steps 100 --workers 1 8 --store-devices gpu
# (a host store moves the convnet's 86 MB each way per push and runs its exchange on the host: a few pushes/s)
timeout 80 $PY experiments/benchmarks/trainer_throughput.py --models convnet --batch 128 --steps 20 --workers 1 --quick \
  --store-devices cpu
[ "${ONLY:-}" = trainer ] && exit 0  # ONLY=trainer: the trainer's figures alone (about 5 minutes)
echo "== simulator vs floor (cnn, W)"; timeout 100 $PY experiments/benchmarks/simulator_overhead.py --quick \
  --only cnn W --scale 2
