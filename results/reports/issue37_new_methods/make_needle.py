"""The 2026 methods beside their relatives on the family needle protocol, one sweep
(same 102 samples for every setting), settings decoded together."""
import sys
import time
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(PROJECT))
from hydra import compose, initialize_config_dir  # noqa: E402

from harness.sweep_run import run_sweep  # noqa: E402

ROOT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/r37/needle"
COMMON = ["model=smollm2_135m", "task=ruler", "task.lengths=[512]", "task.subtasks=[niah_single]",
          "task.depths=[10,50,90]", "task.samples_per_cell=34", "task.max_new_tokens=16",
          "runner.dense_layers=[0,1]", "runner.threads=1", "runner.sweep_decode_batch=10",
          f"runner.results_root={ROOT}"]
SETTINGS = [["method=full"], ["method=snapkv"], ["method=expected_attention"], ["method=qfilters"],
            ["method=kvzip"], ["method=kvzip", "method.level=head", "method.budget_ratio=0.6"],
            ["method=rkv"], ["method=kivi"], ["method=turboquant"], ["method=kvquant"]]
with initialize_config_dir(config_dir=str(PROJECT / "conf"), version_base="1.3"):
    cfgs = [compose(config_name="config", overrides=COMMON + s) for s in SETTINGS]
t0 = time.time()
for o in run_sweep(cfgs):
    print(o.status, o.detail)
print(f"wall {time.time() - t0:.0f} s")
