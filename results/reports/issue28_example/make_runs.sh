#!/usr/bin/env bash
# The small runs behind this example report (issue 28): stories260K and SmolLM2-135M on 2 CPU
# cores, a handful of methods and budgets; then `python -m harness.report` over them.
#   bash results/reports/issue28_example/make_runs.sh /tmp/r28/runs
set -euo pipefail
ROOT=${1:?results root}
export OMP_WAIT_POLICY=PASSIVE
export KVH_SHARED_DIR=${KVH_SHARED_DIR:-$(cd "$(dirname "$0")/../../.." && pwd)/../shared}
H=".venv/bin/python -m harness"


R="runner.results_root=$ROOT runner.skip_existing=true"
# stories260K, streaming perplexity on 400 tokens of PG-19: 8 methods x 3 budgets.
$H model=stories260k $R task.dataset=pg19 task.max_tokens=400 method=full
$H -m model=stories260k $R task.dataset=pg19 task.max_tokens=400 \
    method=h2o,tova,keydiff,oracle_topk,quest,streaming_llm method.budget_ratio=0.1,0.25,0.5
$H -m model=stories260k $R task.dataset=pg19 task.max_tokens=400 method=kivi method.k_bits=2,4 \
    method.v_bits=2 method.residual_tokens=32
$H -m model=stories260k $R task.dataset=pg19 task.max_tokens=400 method=infinigen \
    method.budget_ratio=0.1,0.25
# decode ms vs context: the reference and H2O at three lengths.
$H -m model=stories260k $R task.dataset=pg19 task.max_tokens=150,300,500 method=full
$H -m model=stories260k $R task.dataset=pg19 task.max_tokens=150,300,500 method=h2o \
    method.budget_ratio=0.25
# throughput vs batch: RULER niah_single at 256 tokens, batch 1/2/4.
$H -m model=stories260k $R task=ruler task.lengths=[256] task.subtasks=[niah_single] \
    task.depths=[0,50,100] task.samples_per_cell=4 task.max_new_tokens=16 \
    method=full runner.batch_size=1,2,4
$H -m model=stories260k $R task=ruler task.lengths=[256] task.subtasks=[niah_single] \
    task.depths=[0,50,100] task.samples_per_cell=4 task.max_new_tokens=16 \
    method=h2o method.budget_ratio=0.25 runner.batch_size=1,2,4
# SmolLM2: RULER niah_single (depth x length grid) and streaming perplexity.
$H -m $R task=ruler task.lengths=[256,512] task.subtasks=[niah_single] task.depths=[0,50,100] \
    task.max_new_tokens=16 method=h2o,snapkv,quest,streaming_llm,tova method.budget_ratio=0.25
$H $R task=ruler task.lengths=[256,512] task.subtasks=[niah_single] task.depths=[0,50,100] \
    task.max_new_tokens=16 method=full
$H -m $R task.max_tokens=256 method=full,kivi
$H -m $R task.max_tokens=256 method=h2o,streaming_llm,keydiff method.budget_ratio=0.25
