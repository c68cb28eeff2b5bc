#!/usr/bin/env bash
# The checks that need a CUDA device, as one script (run on a GPU machine from the repository root;
# results go to $OUT, default bench/results/gpu). Uses the machine's own torch (>= 2.6) from src/.
set -u
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
  echo "== GPU-marked tests"
  timeout 400 $PY -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/unit/test_observe_gpu.py tests/distributed/test_trainer_gpu.py 2>&1 | tail -15
  echo "== doctor"
  timeout 120 $PY -m shardwise doctor 2>&1 | tail -25
  echo "== calibrate (1 process)"
  timeout 200 $PY -m shardwise calibrate --nproc 1 --out "$OUT/calibrated_1gpu.json" 2>&1 | tail -8
  echo "== planner vs one GPU"
  timeout 300 $PY bench/planner_gpu.py --out "$OUT/planner_gpu.json" 2>&1 | grep -v Warning | tail -12
} 2>&1 | tee "$OUT/gpu_checks.log"
