#!/usr/bin/env bash
# The runs behind the method-family report (issue 28): every method of the harness on SmolLM2-135M,
# RULER niah_single at 512 and 1024 tokens x depths 10/50/90 % (6 samples), the family protocol
# (runner.dense_layers=[0,1], dense prefill, budget basis final): each method at its authors'
# operating point (its defaults) and, where it takes a budget, at budget_ratio 0.2.
#   bash results/reports/issue28_family/make_runs.sh /tmp/r28f/runs
# then: python -m harness.report /tmp/r28f/runs [<family_table needle/ppl roots>] --out <folder>
set -uo pipefail
ROOT=${1:?results root}
export OMP_WAIT_POLICY=PASSIVE
H=".venv/bin/python -m harness"
COMMON="runner.results_root=$ROOT runner.skip_existing=true runner.threads=1 runner.dense_layers=[0,1]
 task=ruler task.lengths=[512,1024] task.subtasks=[niah_single] task.depths=[10,50,90]
 task.max_new_tokens=16"
BUDGETED="h2o tova keydiff scissorhands streaming_llm snapkv pyramidkv knorm squeezeattention
 oracle_topk quest infinigen shadowkv tailorkv"
for m in $(ls conf/method | grep -v '^_' | sed 's/\.yaml$//'); do
  $H $COMMON method=$m || echo "refused or failed: method=$m"
done
for m in $BUDGETED; do
  for r in 0.2; do
    $H $COMMON method=$m method.budget_ratio=$r || echo "refused or failed: method=$m budget_ratio=$r"
  done
done
