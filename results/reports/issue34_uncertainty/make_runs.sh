# The runs behind this demonstration report (2-core CPU, shared; ~1 h in all). Small n on
# purpose: it shows the intervals, it does not rank methods (the family report needs n >= 100).
set -e
R=${R:-/tmp/stats_demo/runs}
P="python -m harness"
# stories260K, streaming perplexity over the first 400 tokens of PG-19 (399 scored tokens)
S="model=stories260k task.dataset=pg19 task.max_tokens=400 runner.results_root=$R"
$P -m $S method=full,streaming_llm,kivi,oracle_topk hydra.sweep.dir=$R/_sweeps/s1
$P -m $S method=h2o method.budget_ratio=0.1,0.2,0.5 hydra.sweep.dir=$R/_sweeps/s2
$P $S method=full runner.attn_impl=eager            # the noise floor
# SmolLM2-135M, RULER niah_single at 512 tokens, 3 depths x 8 samples = 24 samples
T="model=smollm2_135m task=ruler task.subtasks=[niah_single] task.lengths=[512]
   task.depths=[0,50,100] task.samples_per_cell=8 task.max_new_tokens=12 runner.results_root=$R"
$P -m $T method=full,streaming_llm hydra.sweep.dir=$R/_sweeps/r1
$P $T method=full runner.attn_impl=eager            # the noise floor
$P -m $T method=snapkv method.budget_ratio=0.1,0.5 hydra.sweep.dir=$R/_sweeps/r2
$P $T method=streaming_llm method.window_tokens=128
$P $T method=h2o method.budget_ratio=0.2
python -m harness.report $R --out results/reports/issue34_uncertainty
python -m harness.report.plan $R --half-width 2 > results/reports/issue34_uncertainty/plan.md
