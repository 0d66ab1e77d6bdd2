#!/usr/bin/env bash
# The cross-engine runs of results/reports/vllm (docs/vllm.md): RULER at 1K (6 samples per cell,
# n = 60) and streaming perplexity on WikiText-2 (4096 tokens), through vLLM (full cache in the
# model dtype, fp8 e4m3, fp8 e5m2) and through our engine (full cache), then one report.
# `quant`: our KV quantizers (KIVI, KVQuant, TurboQuant at their defaults) on the same samples, one
# sweep per task (the sweep engine prefills each prompt once for the three).
#   results/reports/vllm/make_runs.sh vllm|ours|quant|tasks|report [ROOT]
# `tasks`: XSum, LongBench (multi_news, 8 samples at 2K) and multi-turn, full cache, both engines.
# `quest`: Quest at its defaults (budget_ratio 0.2) inside vLLM (scripts/kvh_vllm_plugin) and through
# our engine, RULER 1K (make_runs.sh quest).
set -euo pipefail
cd "$(dirname "$0")/../../.."
ROOT=${2:-results/reports/vllm/runs}
export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
RULER=(model=smollm2_135m task=ruler task.lengths=[1024] task.samples_per_cell=6)
PPL=(model=smollm2_135m task=perplexity task.dataset=wikitext2 task.max_tokens=4096)
XSUM=(model=smollm2_135m task=xsum task.limit=20)
LONGBENCH=(model=smollm2_135m task=longbench task.limit=8 task.max_length_tokens=2048
           task.max_new_tokens=128)
MULTITURN=(model=smollm2_135m task=multiturn task.samples=10 task.turns=4)
for_both() {  # one task's overrides: through vLLM (full cache, KV auto), then through ours
    .venv/bin/python -m harness.engines.vllm_engine "$@" vllm.kv_space_gib=1 runner.results_root="$ROOT"
    .venv/bin/python -m harness "$@" method=full runner.results_root="$ROOT"
}
case "$1" in
vllm)
    for kv in auto fp8_e4m3 fp8_e5m2; do
        .venv/bin/python -m harness.engines.vllm_engine "${RULER[@]}" vllm.kv_cache_dtype=$kv \
            runner.results_root="$ROOT"
        .venv/bin/python -m harness.engines.vllm_engine "${PPL[@]}" vllm.kv_cache_dtype=$kv \
            runner.results_root="$ROOT"
    done ;;
ours)
    .venv/bin/python -m harness "${RULER[@]}" method=full runner.results_root="$ROOT"
    .venv/bin/python -m harness "${PPL[@]}" method=full runner.results_root="$ROOT" ;;
quant)
    .venv/bin/python -m harness -m "${RULER[@]}" method=kivi,kvquant,turboquant \
        runner.results_root="$ROOT" hydra.sweep.dir="$ROOT/_sweeps/ruler"
    .venv/bin/python -m harness -m "${PPL[@]}" method=kivi,kvquant,turboquant \
        runner.results_root="$ROOT" hydra.sweep.dir="$ROOT/_sweeps/ppl" ;;
tasks)
    # the other generating tasks, full cache, through both engines on the same samples
    for_both "${XSUM[@]}"; for_both "${LONGBENCH[@]}"; for_both "${MULTITURN[@]}" ;;
quest)
    # Quest inside vLLM (the project's plugin, docs/vllm.md) and ours, same samples and knobs;
    # 16 sequences at once fit the 1 GiB KV space whole, so vLLM preempts none
    .venv/bin/python -m harness.engines.vllm_engine "${RULER[@]}" method=quest vllm.kv_space_gib=1 \
        vllm.max_num_seqs=16 runner.results_root="$ROOT"
    .venv/bin/python -m harness "${RULER[@]}" method=quest runner.results_root="$ROOT" ;;
report)
    .venv/bin/python -m harness.report "$ROOT" --out results/reports/vllm/report ;;
*) echo "usage: $0 vllm|ours|quant|tasks|report [ROOT]" >&2; exit 2 ;;
esac
