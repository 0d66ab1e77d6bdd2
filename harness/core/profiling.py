"""Timers and memory probes that tell the truth on CPU and CUDA.

On CUDA, regions are timed with CUDA events (read after a synchronize); on CPU with
`perf_counter`. Peak memory is CUDA max-allocated on GPU and the process's peak RSS (VmHWM, reset
per run through /proc/self/clear_refs) on CPU.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch


class Timer:
    """Accumulates named regions; `with timer.region("decode"):` records milliseconds."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._pending: list[tuple[str, object, object]] = []
        self.ms: dict[str, list[float]] = {}

    def region(self, name: str) -> "_Region":
        return _Region(self, name)

    def _record(self, name: str, ms: float) -> None:
        self.ms.setdefault(name, []).append(ms)

    def flush(self) -> None:
        """Resolve pending CUDA-event pairs (one synchronize for all of them)."""
        if self._pending:
            torch.cuda.synchronize(self.device)
            for name, start, end in self._pending:
                self._record(name, start.elapsed_time(end))
            self._pending.clear()

    def add(self, name: str, ms: list[float]) -> None:
        """Regions timed elsewhere, counted as this timer's (a prefill shared by a sweep)."""
        self.ms.setdefault(name, []).extend(ms)

    def values(self, name: str) -> list[float]:
        self.flush()
        return list(self.ms.get(name, []))


class _Region:
    def __init__(self, timer: Timer, name: str):
        self.timer, self.name = timer, name

    def __enter__(self):
        if self.timer.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.timer.cuda:
            self.end.record()
            self.timer._pending.append((self.name, self.start, self.end))
        else:
            self.timer._record(self.name, (time.perf_counter() - self.t0) * 1e3)
        return False


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1)))))
    return ordered[rank]


@dataclass
class SpeedSummary:
    prefill_ms_total: float = 0.0
    prefill_tokens: int = 0
    decode_steps: int = 0
    decode_ms: list[float] = field(default_factory=list)
    decode_tokens: int = 0  # tokens decoded over all sequences (= steps at batch 1)
    ttft_ms: list[float] = field(default_factory=list)  # per request, under a device limit

    def as_dict(self) -> dict[str, float | int | None]:
        # Per token = per decode step: at batch B every sequence gets one token per step, so the
        # step time is each sequence's time per output token; throughput counts every sequence.
        d = self.decode_ms
        median = statistics.median(d) if d else None
        tokens = self.decode_tokens or len(d)
        return {
            "prefill_ms_total": round(self.prefill_ms_total, 3),
            "prefill_tokens": self.prefill_tokens,
            "prefill_tokens_per_s": (round(self.prefill_tokens / self.prefill_ms_total * 1e3, 3)
                                     if self.prefill_ms_total > 0 else None),
            "decode_steps": self.decode_steps,
            "decode_ms_per_token_median": round(median, 4) if median is not None else None,
            "decode_ms_per_token_p90": round(percentile(d, 90), 4) if d else None,
            "decode_tokens": tokens,
            "decode_tokens_per_s": round(tokens * 1e3 / sum(d), 3) if d and sum(d) > 0 else None,
            # time to first token from the moment all requests arrived (harness.core.serving); only
            # under runner.kv_device_limit_mib, where requests are queued and admitted
            **({} if not self.ttft_ms else {
                "ttft_ms_mean": round(statistics.fmean(self.ttft_ms), 3),
                "ttft_ms_p90": round(percentile(self.ttft_ms, 90), 3),
                "ttft_ms_max": round(max(self.ttft_ms), 3)}),
        }


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        try:  # "5" resets the peak RSS (VmHWM) of this process (Linux >= 4.0)
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass


def peak_memory(device: torch.device) -> dict[str, float | int | str | None]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return {"kind": "cuda_max_allocated", "peak_bytes": int(torch.cuda.max_memory_allocated(device)),
                "rss_bytes": _proc_status_kb("VmRSS")}
    hwm = _proc_status_kb("VmHWM")
    return {"kind": "cpu_peak_rss", "peak_bytes": hwm, "rss_bytes": _proc_status_kb("VmRSS")}


def _proc_status_kb(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
