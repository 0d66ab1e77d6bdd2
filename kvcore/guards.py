"""What every KV allocation checks first: the memory it would take, and a stop asked by a signal.

* **Memory guard** (`check_allocation`): storage sized from user knobs (a paged pool growing,
  a contiguous buffer of batch x length, a host-tier buffer) estimates its bytes before it
  allocates; more than the memory available on that device (Linux: MemAvailable, within the
  cgroup's limit; CUDA: free + cached) raises `MemoryLimit`, one line with the estimate and the
  limit, instead of swapping the machine to a halt or being killed by the OOM killer. Small
  allocations (< GUARD_MIN_BYTES) are not checked: they cannot be what exhausts the machine.
* **Sizes typed as knobs** (`size_reason`): a task's lengths and sample counts, a method's page
  size, estimated before anything loads from what they will allocate (the KV of the longest
  sequence, the prompts built, a padded page), against the memory available; the model's max
  positions are no bound (a config may claim 10^12).
* **Stop** (`request_stop` / `check_stop`): the CLI's SIGINT/SIGTERM handler raises
  KeyboardInterrupt and records the request; a KeyboardInterrupt raised where Python discards it
  (inside a finalizer) would be lost, so storage writes and allocations check the record between
  chunks and raise it again: a signal stops a long prefill or a growing pool at the next write.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kvcore.errors import ConfigError

GUARD_MIN_BYTES = 64 * 2**20
# Host bytes a built prompt takes per token before it is fed: its text (~4 bytes a token), the
# Python list of ids (~36 bytes an int) and the tokenizer's encoding (ids, offsets, masks: ~40),
# rounded up.
PROMPT_HOST_BYTES_PER_TOKEN = 128
_stop = {"requested": False}


class MemoryLimit(ConfigError):
    """An allocation sized from the config would not fit in the memory available."""


def request_stop() -> None:
    _stop["requested"] = True


def clear_stop() -> None:
    _stop["requested"] = False


def check_stop() -> None:
    if _stop["requested"]:
        raise KeyboardInterrupt


def _meminfo_bytes(key: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_free_bytes() -> int | None:
    """Room left under a cgroup v2 memory limit (None: no limit or not readable)."""
    root = Path("/sys/fs/cgroup")
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((root / "memory.current").read_text()))
    except (OSError, ValueError):
        return None


def available_bytes(device: torch.device) -> int | None:
    """Memory an allocation on `device` can still take (None: unknown, not checked)."""
    if device.type == "cuda":
        try:
            free, _ = torch.cuda.mem_get_info(device)
            return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        except (RuntimeError, AssertionError):
            return None
    if device.type != "cpu":
        return None
    free = [b for b in (_meminfo_bytes("MemAvailable"), _cgroup_free_bytes()) if b is not None]
    return min(free) if free else None


def fmt_bytes(nbytes: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes / 2**10:.1f} KiB"


def size_reason(knob: str, nbytes: int, what: str, device: torch.device | str = "cpu"
                ) -> str | None:
    """Why the size typed in `knob` cannot fit: `nbytes` (what it allocates: `what`) beyond the
    memory available on `device`; None when it fits or is small."""
    if nbytes < GUARD_MIN_BYTES:
        return None
    device = torch.device(device)
    free = available_bytes(device)
    if free is None or nbytes <= free:
        return None
    return (f"{knob}: {what} would need {fmt_bytes(nbytes)} but {fmt_bytes(free)} of "
            f"{device.type} memory is available; lower it")


def check_allocation(nbytes: int, device: torch.device | str, what: str) -> None:
    """Raise MemoryLimit when `nbytes` on `device` exceed what is available (module docstring);
    also the point where a requested stop takes effect."""
    check_stop()
    if nbytes < GUARD_MIN_BYTES:
        return
    device = torch.device(device)
    free = available_bytes(device)
    if free is not None and nbytes > free:
        raise MemoryLimit(
            f"{what} would need {fmt_bytes(nbytes)} but {fmt_bytes(free)} of {device.type} memory "
            f"is available (pid {os.getpid()}); lower runner.batch_size, runner.kv_block_tokens "
            "or the task's lengths")
