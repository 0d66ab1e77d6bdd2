#!/usr/bin/env bash
# All GPU checks in one go, for a lent GPU machine (~6 min). Prepare the wheels here first with
# scripts/fetch_gpu_wheels.sh, then run with `.whl` carried:
#   device run (carry [".whl"]):  bash scripts/gpu_check.sh
# Writes $OUT/gpu_summary.json (or ./gpu_summary.json) and $OUT/gpu_log.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-.}"
LOG="$OUT_DIR/gpu_log.txt"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:$PWD" || exit 1
else
  export PYTHONPATH="$PWD"
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
  # 1. CUDA-marked tests (kernels at full size, offload path with pinned memory and streams)
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tail -15
  # 2. offload speed: full_offload vs InfiniGen vs H2O-offload at >= 8K context, random 1B Llama
  timeout 300 python3 benchmarks/offload_speed.py --model random_llama_1b --device cuda \
    --dtype bfloat16 --contexts 8192 16384 --new-tokens 32 --rounds 2 \
    --json "$OUT_DIR/gpu_summary.json"
} 2>&1 | tee "$LOG"
