"""`python -m harness.lm_eval <lm-eval CLI arguments>`: lm-eval's own CLI with `kvharness` known.

lm-eval's CLI cannot discover plug-in models (no entry points), so this imports our model (which
registers `kvharness`) and hands the unchanged command line to `lm_eval.__main__.cli_evaluate()`.
Our own configuration errors print as one line (exit 2) instead of a traceback.

    python -m harness.lm_eval --model kvharness \
        --model_args model=smollm2_135m,method=h2o,budget_ratio=0.2,scoring=stepwise \
        --tasks copa --include_path "$(python -m harness.lm_eval.tasks)" --num_fewshot 5 --limit 10
"""

import os
import sys

# Before torch loads (as `python -m harness`): passive OpenMP waits on small machines.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from lm_eval.__main__ import cli_evaluate  # noqa: E402

import harness.lm_eval  # noqa: E402,F401  (registers the kvharness model)
from harness.lm_eval.model import ACTIVITY  # noqa: E402
from kvcore.errors import ConfigError  # noqa: E402


def main() -> None:
    try:
        cli_evaluate()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except ValueError as exc:  # lm-eval's own bad input, as one line (exit 2)
        text = str(exc)
        if not text.startswith("Tasks not found"):
            raise
        print(f"error: lm-eval: {text} (`python -m harness.lm_eval ls tasks` lists lm-eval's "
              "tasks; ours are under --include_path \"$(python -m harness.lm_eval.tasks)\")",
              file=sys.stderr)
        sys.exit(2)
    flag_inactive()


def flag_inactive() -> None:
    """An lm-eval run whose KV method did not act is flagged, as the runner flags its own
    (its results record kvharness_method_active=false)."""
    for method, state in ACTIVITY:
        if state.get("method_active") is False:
            print(f"INACTIVE: method={method} did not act: {state['inactive_reason']}",
                  file=sys.stderr)


if __name__ == "__main__":
    main()
