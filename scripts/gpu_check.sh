#!/usr/bin/env bash
# All GPU checks in one go, for a lent GPU machine (<= 8 min: each step has its own timeout, so a
# slow one costs its part only). Prepare the wheels here first with scripts/fetch_gpu_wheels.sh,
# then run with `.whl` carried:
#   device run (carry [".whl"]):  bash scripts/gpu_check.sh
# Writes $OUT/gpu_summary.json, $OUT/gpu_table.md (or ./) and $OUT/gpu_log.txt:
#   1. CUDA-marked tests (offload tier pinned/overlapped/exposed ms, KIVI fused kernel at 32K,
#      sparse attention kernel at Llama scale)
#   2. kernel bandwidth: sparse-attention and KIVI-2 kernels, achieved GB/s vs the 4.8 TB/s peak
#   3. throughput, random Llama-3-8B shape in bf16: full, full_offload, InfiniGen, H2O-offload and
#      KIVI-2 at 8K and 32K context, batch 1 and 8 (tok/s, KV per tier, transfer vs exposed ms)
#   4. the same at 8K for the 1B shape
# Goals printed: InfiniGen >= 2x full_offload decode tok/s at >= 8K; kernels >= 70 % of peak.
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
  timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider --junitxml "$TMP_DIR/gpu_tests.xml" \
    tests/kvcore/test_offload.py tests/methods/test_kivi.py tests/methods/kernels 2>&1 | tail -15
  timeout 50 python3 benchmarks/kernel_bandwidth.py --contexts 8192 32768 --batches 1 8 \
    --json "$TMP_DIR/kernels.json"
  timeout 260 python3 benchmarks/throughput.py --model random_llama_8b --device cuda \
    --dtype bfloat16 --prompt-tokens 8192 32768 --batches 1 8 --new-tokens 16 \
    --methods full full_offload infinigen h2o_offload kivi --kv-memory-gib 100 \
    --json "$TMP_DIR/throughput_8b.json"
  timeout 60 python3 benchmarks/throughput.py --model random_llama_1b --device cuda \
    --dtype bfloat16 --prompt-tokens 8192 --batches 1 8 --new-tokens 16 \
    --methods full full_offload infinigen h2o_offload kivi --kv-memory-gib 100 \
    --json "$TMP_DIR/throughput_1b.json"
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
summary = {"gpu_tests": tests, "kernels": load("kernels.json"),
           "throughput_8b": load("throughput_8b.json"), "throughput_1b": load("throughput_1b.json")}
lines = ["| model | context | batch | method | decode tok/s | x full_offload | x full | "
         "transfer ms/step | exposed ms/step |", "|" + "---|" * 9]
goals = {}
for key in ("throughput_8b", "throughput_1b"):
    run = summary[key]
    for ctx, part in ((run or {}).get("contexts") or {}).items():
        for method, per_batch in part["cells"].items():
            for b, c in per_batch.items():
                off = part["cells"].get("full_offload", {}).get(b)
                full = part["cells"].get("full", {}).get(b)
                x_off = c["decode_tokens_per_s"] / off["decode_tokens_per_s"] if off else None
                x_full = c["decode_tokens_per_s"] / full["decode_tokens_per_s"] if full else None
                if method == "infinigen" and x_off is not None:
                    goals[f"{key} {ctx} B={b} infinigen/full_offload >= 2"] = round(x_off, 3)
                fmt = lambda v: "-" if v is None else f"{v:.2f}"
                lines.append(f"| {run['model']} | {ctx} | {b} | {method} | "
                             f"{c['decode_tokens_per_s']:.1f} | {fmt(x_off)} | {fmt(x_full)} | "
                             f"{c['transfer_ms_per_step']:.2f} | {c['exposed_ms_per_step']:.2f} |")
for row in (summary["kernels"] or {}).get("rows", []):
    goals[f"{row['kernel']} B={row['batch']} T={row['context']} share of peak >= 0.7"] = round(
        row["share_of_peak"], 3)
summary["goals"] = goals
for name, value in goals.items():
    print(f"goal {name}: {value}")
table = dest.with_name("gpu_table.md")
table.write_text("\n".join(lines) + "\n")
print("\n".join(lines))
part = dest.with_suffix(".json.tmp")
part.write_text(json.dumps(summary, indent=2))
part.replace(dest)
PY
} 2>&1 | tee "$LOG"
rm -rf "$TMP_DIR"
