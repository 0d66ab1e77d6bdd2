"""`python -m harness model=... method=... task=...` (Hydra)."""

import os
import signal

# Before torch loads: OpenMP's active spin-wait makes 2-core machines ~25x slower under any
# contention (stack.md §3). A user's explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from harness.run import main_guarded  # noqa: E402


def _terminate(signum, frame):  # SIGTERM unwinds like Ctrl-C: staging removed, nothing partial
    raise KeyboardInterrupt


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    signal.signal(signal.SIGTERM, _terminate)
    main_guarded(cfg)


if __name__ == "__main__":
    main()
