#!/usr/bin/env bash
# The 4K table in rounds (issue #50 item 4): RULER at 4096 tokens (niah_single, niah_multikey, vt;
# 3 cells, 20 samples each), SmolLM2-135M, the family protocol (dense layers 0 and 1), the
# methods that take a budget at budget_ratio 0.2, fidelity over the full cache's first 12 answer
# tokens. Rounds of 12 samples (4 per cell) up to 60 per setting; each setting is compared with
# the full cache only (no top-k question). The 23 methods are split in two sweeps, run side by
# side on the two cores, each with its own full cache and ledger; each spends alpha 0.025, so
# the error over both ledgers' questions and rounds is at most 0.05 (Bonferroni).
# ShadowKV is left out: its official threshold (prompts over 4096 tokens) leaves every 4K RULER
# prompt whole, so it would be the full cache again. DuoAttention is refused at 0.2: its
# retrieval heads alone hold 0.5 of the cache on this model (the official GQA share).
# Extra arguments go to the rounds command (e.g. rounds.ledger_dir=..., rounds.max_n=...).
#   results/reports/ruler4k_rounds/make_runs.sh A R &
#   results/reports/ruler4k_rounds/make_runs.sh B R
set -euo pipefail
part=$1 root=$2
shift 2
case $part in
  A) methods=adakv,expected_attention,headkv,keydiff,kvzip,oracle_topk,qfilters,razor_attention,scissorhands,squeezeattention,tailorkv,tova ;;
  B) methods=h2o,infinigen,knorm,lagkv,pyramidkv,quest,rkv,snapkv,streaming_llm,tidaldecode ;;
  razor) # RazorAttention again, alone: ledger A's rows of it were made before the fork fix of
    # 2026-12-06 (an adopted prompt state lost its compensation slot's mark), so its question
    # there is withdrawn; here it spends A's per-question alpha (0.025 / 12), keeping the total
    exec python -m harness.sweep.rounds model=smollm2_135m task=ruler "task.lengths=[4096]" \
      "task.depths=[50]" "task.subtasks=[niah_single,niah_multikey,vt]" task.samples_per_cell=20 \
      task.fidelity_tokens=12 "runner.dense_layers=[0,1]" runner.threads=1 \
      runner.sweep_decode_batch=12 "runner.results_root=$root/razor" \
      method=razor_attention method.budget_ratio=0.2 \
      rounds.block=12 rounds.max_n=60 rounds.alpha=0.0020833333 rounds.margin_points=10 "$@" ;;
  floor) # the noise floor: the full cache through eager attention on the same 60 samples
    # (no fidelity: the full cache's fidelity to the full cache is zero by construction)
    exec python -m harness -m method=full runner.attn_impl=eager model=smollm2_135m task=ruler \
      "task.lengths=[4096]" "task.depths=[50]" "task.subtasks=[niah_single,niah_multikey,vt]" \
      task.samples_per_cell=20 task.fidelity_tokens=0 "runner.dense_layers=[0,1]" \
      runner.threads=1 "runner.results_root=$root/floor" ;;
  *) echo "usage: $0 A|B|razor|floor RESULTS_ROOT" >&2; exit 2 ;;
esac
exec python -m harness.sweep.rounds model=smollm2_135m task=ruler "task.lengths=[4096]" \
  "task.depths=[50]" "task.subtasks=[niah_single,niah_multikey,vt]" task.samples_per_cell=20 \
  task.fidelity_tokens=12 "runner.dense_layers=[0,1]" runner.threads=1 \
  runner.sweep_decode_batch=12 "runner.results_root=$root/$part" \
  "method=$methods" method.budget_ratio=0.2 \
  rounds.block=12 rounds.max_n=60 rounds.alpha=0.025 rounds.margin_points=10 "$@"
