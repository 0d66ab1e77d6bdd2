"""The 2026 methods beside their relatives on streaming perplexity (family protocol:
dense layers 0 and 1; a 1024-token prompt compressed at its end, 1024 scored tokens after it)."""
import sys
import time
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(PROJECT))
from hydra import compose, initialize_config_dir  # noqa: E402

from harness.sweep_run import run_sweep  # noqa: E402

ROOT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/r37/perplexity"
COMMON = ["model=smollm2_135m", "task=perplexity", "task.max_tokens=2048",
          "task.prefill_tokens=1024", "runner.dense_layers=[0,1]", "runner.threads=1",
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
