#!/usr/bin/env bash
# The runs behind tables.md (issue 25): every family row's needle run, streamed perplexity and
# prompt-protocol perplexity, each a harness run under <root>, resumable (skip_existing).
#   bash results/reports/issue25_family/make_runs.sh /tmp/fam
set -uo pipefail
ROOT=${1:?results root}
export OMP_WAIT_POLICY=PASSIVE
PY=.venv/bin/python
X="--extra runner.skip_existing=true runner.threads=1"
$PY benchmarks/needle_table.py --threads 1 --results-root "$ROOT/needle"
$PY benchmarks/perplexity_table.py --preset families --dataset wikitext2 --max-tokens 1024 \
    --results-root "$ROOT/ppl" $X
$PY benchmarks/perplexity_table.py --preset families --dataset wikitext2 --max-tokens 1024 \
    --prefill-tokens 512 --results-root "$ROOT/ppl_prompt" $X \
    --methods adakv duo_attention fastgen headkv knorm kvmerger minicache pyramidkv \
              razor_attention shadowkv snapkv squeezeattention tailorkv oracle_topk
