"""Whether processes live, for the tests that kill a parent and watch its children go."""

import time
from pathlib import Path


def alive(pid: int) -> bool:
    """True while `pid` runs; a zombie has stopped (nobody may reap it here)."""
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state


def gone_within(pids: list[int], timeout_s: float) -> bool:
    """Wait up to `timeout_s` for every one of `pids` to stop; whether they all did."""
    deadline = time.time() + timeout_s
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.1)
    return not any(alive(p) for p in pids)
