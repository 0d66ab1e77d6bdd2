#!/usr/bin/env bash
# All GPU checks in one go, for a lent GPU machine (~8 min). Prepare the wheels here first with
# scripts/fetch_gpu_wheels.sh, then run with `.whl` carried:
#   device run (carry [".whl"]):  bash scripts/gpu_check.sh
# Writes $OUT/gpu_summary.json (or ./gpu_summary.json) and $OUT/gpu_log.txt:
#   gpu_summary.json = {"gpu_tests": {...}, "offload": <offload_speed summary>,
#                       "kivi_vs_full": <KIVI-2 vs full at 8K/32K, ms_per_token_vs_full>}
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-.}"
LOG="$OUT_DIR/gpu_log.txt"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# compiled Triton kernels, not the interpreter (tests/conftest.py defaults it to 1 for CPU runs)
export TRITON_INTERPRET=0
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:$PWD" || exit 1
else
  export PYTHONPATH="$PWD"
fi
TMP_DIR="$(mktemp -d)"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
  # 1. CUDA-marked tests: offload tier (pinned, contiguous, overlapped, exposed ms), fused KIVI
  #    decode kernel at 32K, sparse attention kernel at Llama scale
  timeout 180 python3 -m pytest -q -m gpu -p no:cacheprovider --junitxml "$TMP_DIR/gpu_tests.xml" \
    tests/kvcore/test_offload.py tests/methods/test_kivi.py tests/methods/kernels 2>&1 | tail -15
  # 2. offload speed: full_offload vs InfiniGen vs H2O-offload at >= 8K context, random 1B Llama
  timeout 240 python3 benchmarks/offload_speed.py --model random_llama_1b --device cuda \
    --dtype bfloat16 --contexts 8192 16384 --new-tokens 32 --rounds 2 --json "$TMP_DIR/offload.json"
  # 3. KIVI-2 (fused kernel) vs the full cache, both device-resident, at 8K and 32K
  timeout 150 python3 benchmarks/offload_speed.py --model random_llama_1b --device cuda \
    --dtype bfloat16 --methods full kivi_2bit --contexts 8192 32768 --new-tokens 32 --rounds 2 \
    --json "$TMP_DIR/kivi.json"
  # one summary, written atomically; a missing part is recorded as null
  python3 - "$TMP_DIR" "$OUT_DIR/gpu_summary.json" <<'PY'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
tmp, dest = Path(sys.argv[1]), Path(sys.argv[2])
def load(name):
    p = tmp / name
    return json.loads(p.read_text()) if p.exists() else None
tests = None
if (tmp / "gpu_tests.xml").exists():
    suite = ET.parse(tmp / "gpu_tests.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    tests = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
summary = {"gpu_tests": tests, "offload": load("offload.json"), "kivi_vs_full": load("kivi.json")}
kivi = summary["kivi_vs_full"]
if kivi:
    summary["kivi_2bit_ms_per_token_vs_full"] = {
        ctx: rows.get("kivi_2bit", {}).get("ms_per_token_vs_full")
        for ctx, rows in kivi["contexts"].items()}
    print("KIVI-2 ms/token vs full:", summary["kivi_2bit_ms_per_token_vs_full"])
part = dest.with_suffix(".json.tmp")
part.write_text(json.dumps(summary, indent=2))
part.replace(dest)
PY
} 2>&1 | tee "$LOG"
rm -rf "$TMP_DIR"
