"""The runs behind this report: the 2026 methods beside their relatives on the family protocol
(SmolLM2-135M, dense layers 0 and 1, dense prefill, budget basis final), one sweep per task so
that every setting is scored on the same samples.

    python results/reports/issue37_new_methods/make_runs.py needle R/needle
    python results/reports/issue37_new_methods/make_runs.py perplexity R/perplexity

needle: RULER niah_single, 512 tokens, depths 10/50/90 %, 34 samples each (n = 102), query-aware,
16 new tokens, settings decoded together; perplexity: the essays, a 1024-token prompt compressed
at its end, then 1024 tokens scored one at a time.
"""
import sys
import time
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(PROJECT))
from hydra import compose, initialize_config_dir  # noqa: E402

from harness.sweep.run import run_sweep  # noqa: E402

TASKS = {
    "needle": ["task=ruler", "task.lengths=[512]", "task.subtasks=[niah_single]",
               "task.depths=[10,50,90]", "task.samples_per_cell=34", "task.max_new_tokens=16",
               "runner.sweep_decode_batch=10"],
    "perplexity": ["task=perplexity", "task.max_tokens=2048", "task.prefill_tokens=1024"],
}
SETTINGS = [["method=full"], ["method=snapkv"], ["method=expected_attention"], ["method=qfilters"],
            ["method=kvzip"], ["method=kvzip", "method.level=head", "method.budget_ratio=0.6"],
            ["method=rkv"], ["method=kivi"], ["method=turboquant"], ["method=kvquant"]]


def main(task: str, root: str) -> None:
    common = ["model=smollm2_135m", *TASKS[task], "runner.dense_layers=[0,1]",
              "runner.threads=1", f"runner.results_root={root}"]
    with initialize_config_dir(config_dir=str(PROJECT / "conf"), version_base="1.3"):
        cfgs = [compose(config_name="config", overrides=common + s) for s in SETTINGS]
    t0 = time.time()
    for outcome in run_sweep(cfgs):
        print(outcome.status, outcome.detail)
    print(f"wall {time.time() - t0:.0f} s")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in TASKS:
        raise SystemExit(f"usage: make_runs.py {{{'|'.join(TASKS)}}} <results root>")
    main(sys.argv[1], sys.argv[2])
