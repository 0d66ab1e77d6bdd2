#!/usr/bin/env bash
# All GPU checks in one go, for a lent GPU machine (<= 8 min: each step has its own timeout, so a
# slow one costs its part only: 230 + 80 + 70 + 55 s, + ~30 s of installs and start-up; give the
# device call timeout_s >= 500). Prepare the wheels here first with scripts/fetch_gpu_wheels.sh,
# then run with `.whl` carried:
#   device run (carry [".whl"]):  bash scripts/gpu_check.sh
# Writes into $OUT (or ./gpu_out): gpu_summary.json, gpu_table.md, gpu_log.txt, and the parts
# (gpu_parts/: pytest output + junit xml, kernels.json, throughput_*.json). Steps, most important
# first (benchmarks rewrite their JSON after every cell, so a step cut by its timeout keeps what
# it measured; scripts/gpu_summary.py records a missing part or cell as null, with the reason):
#   1. throughput, random Llama-3-8B shape in bf16, batch 1 at 8K and 32K first, then batch 8:
#      full, KIVI-2, full_offload, InfiniGen, H2O-offload (tok/s, KV per tier, transfer vs
#      exposed ms). Not run: the host-tier methods at 32K x batch 8 (full_offload, InfiniGen): their
#      pinned host stores would need ~116 GiB of the 128 GiB (see the note at MEMORY below)
#   2. CUDA-marked tests (offload tier pinned/overlapped/exposed ms, KIVI fused kernel at 32K,
#      KVQuant fused kernel at 16K, sparse attention kernel at Llama scale, ragged-head paged
#      decode kernel at 8K)
#   3. kernel bandwidth: sparse-attention, KIVI-2 and ragged-head paged decode (per-head block
#      tables) kernels, achieved GB/s vs the 4.8 TB/s peak; then KVQuant's fused kernel
#      (nuq4, 1 % outliers, batch 1; reported, no bound)
#   4. throughput at 8K for the 1B shape
# Goals printed: InfiniGen >= 2x full_offload decode tok/s at >= 8K; KIVI-2 vs full decode tok/s
# at 8K and 32K (reported); kernels >= 70 % of peak; the CUDA tests ran and passed.
#
# GPU_CHECK_DRY=1: a CPU rehearsal of every step (tiny random model, tiny sizes, Triton
# interpreter), marked "dry_run" in every file; without it the run refuses to start unless CUDA
# is there, and every benchmark is asked for --device cuda (no CPU fallback).
#
# MEMORY (8B, bf16; KV per token = 32 layers x 8 KV heads x 128 x 2 (K,V) x 2 B = 128 KiB):
#   full at 32K x 8: 32784 tokens x 8 x 128 KiB = 32 GiB (33 GiB with the 1.5x growth slack) +
#   16 GB weights + prefill transients (2048-token chunks, last-row logits only): ~55 GB of 141.
#   Host tier: HostKVStore doubles its capacity (2 x needed at each growth) and the pinned
#   caching allocator rounds blocks up to powers of two and keeps the freed ones: at 32K x 8 one
#   method holds 64 x 1 GiB live + 64 x (512 + 256 + 64) MiB cached = ~116 GiB pinned: skipped.
#   32K x 1 ~14.5 GiB, 8K x 8 ~20 GiB (cached across methods and cells: ~35 GiB in all).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-gpu_out}"
PARTS="$OUT_DIR/gpu_parts"
LOG="$OUT_DIR/gpu_log.txt"
mkdir -p "$OUT_DIR" && rm -rf "$PARTS" && mkdir -p "$PARTS" || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# InfiniGen's skewing artefacts (computed at prepare) go somewhere writable on a bare machine
export KVH_CACHE_DIR="${KVH_CACHE_DIR:-/tmp/kvh-cache}"
if [ "${GPU_CHECK_DRY:-0}" = 1 ]; then
  DRY=(--dry-run) DEVICE=cpu DTYPE=bfloat16 BIG=random_llama_tiny SMALL=random_llama_tiny
  BIG_CTX="64 192" SMALL_CTX="64" BATCHES="1 2" NEW=4 KERNEL_CTX="256" KERNEL_B="1"
  SKIP="full_offload:192:2 infinigen:192:2"
  export TRITON_INTERPRET=1  # the CPU stand-in for compiled kernels
else
  DRY=() DEVICE=cuda DTYPE=bfloat16 BIG=random_llama_8b SMALL=random_llama_1b
  BIG_CTX="8192 32768" SMALL_CTX="8192" BATCHES="1 8" NEW=16 KERNEL_CTX="8192 32768" KERNEL_B="1 8"
  SKIP="full_offload:32768:8 infinigen:32768:8"  # pinned host memory: see MEMORY above
  # compiled Triton kernels, not the interpreter (tests/conftest.py defaults it to 1 for CPU runs)
  export TRITON_INTERPRET=0
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:$PWD" || exit 1
else
  export PYTHONPATH="$PWD"
fi
csv() { echo "$1" | tr ' ' ','; }
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
  free -g 2>&1 | head -2
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
  if [ "$DEVICE" = cuda ] && ! python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "gpu_check: CUDA is not available here: nothing measured (GPU_CHECK_DRY=1 rehearses on CPU)"
  else
    echo "== 1. throughput $BIG ($(date +%T))"
    timeout -k 10 230 python3 benchmarks/throughput.py --model "$BIG" --device "$DEVICE" \
      --dtype "$DTYPE" --prompt-tokens $BIG_CTX --batches $BATCHES --new-tokens "$NEW" --order batch \
      --methods full kivi full_offload infinigen h2o_offload --skip-cells $SKIP --kv-memory-gib 100 \
      --json "$PARTS/throughput_8b.json"
    echo "== 2. CUDA-marked tests ($(date +%T))"
    timeout -k 10 80 python3 -m pytest -q -m gpu -p no:cacheprovider -rs \
      --junitxml "$PARTS/gpu_tests.xml" \
      tests/kvcore/test_offload.py tests/methods/test_kivi.py tests/methods/kernels \
      > "$PARTS/gpu_tests.txt" 2>&1
    tail -30 "$PARTS/gpu_tests.txt"
    echo "== 3. kernel bandwidth ($(date +%T))"
    timeout -k 10 70 python3 benchmarks/kernel_bandwidth.py --contexts $KERNEL_CTX \
      --batches $KERNEL_B ${DRY[@]+"${DRY[@]}"} --json "$PARTS/kernels.json"
    echo "== 4. throughput $SMALL ($(date +%T))"
    timeout -k 10 55 python3 benchmarks/throughput.py --model "$SMALL" --device "$DEVICE" \
      --dtype "$DTYPE" --prompt-tokens $SMALL_CTX --batches $BATCHES --new-tokens "$NEW" \
      --order batch --methods full kivi full_offload infinigen h2o_offload --kv-memory-gib 100 \
      --json "$PARTS/throughput_1b.json"
    echo "== summary ($(date +%T))"
  fi
  # one summary, written atomically; a missing part or cell is recorded as null (with why)
  python3 scripts/gpu_summary.py "$PARTS" "$OUT_DIR" ${DRY[@]+"${DRY[@]}"} \
    --expect "throughput_8b:$(csv "$BIG_CTX"):$(csv "$BATCHES")" \
    --expect "throughput_1b:$(csv "$SMALL_CTX"):$(csv "$BATCHES")" \
    --expect "kernels:$(csv "$KERNEL_CTX"):$(csv "$KERNEL_B")"
} 2>&1 | tee "$LOG"
