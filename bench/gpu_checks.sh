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
  timeout 400 $PY -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/unit/test_observe_gpu.py tests/distributed/test_trainer_gpu.py 2>&1 | tail -3
  echo "== calibrate (1 process)"
  SHARDWISE_CACHE_DIR="$OUT/cache" timeout 200 $PY -m shardwise calibrate --nproc 1 --out "$OUT/calibrated_1gpu.json" 2>&1 | tail -9
  echo "== planner vs one GPU (preset and calibrated spec)"
  timeout 300 $PY bench/planner_gpu.py --spec "$OUT/calibrated_1gpu.json" --out "$OUT/planner_gpu.json" 2>&1 | grep -v Warning | tail -6
  echo "== Trainer(plan='auto') on one GPU: measures the GPU once, then reads the cache"
  rm -rf "$OUT/cache2"; SHARDWISE_CACHE_DIR="$OUT/cache2" timeout 300 $PY bench/gpu_auto_trainer.py 2>&1 | grep -v Warning | tail -6
} 2>&1 | tee "$OUT/gpu_checks.log"
