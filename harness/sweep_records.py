"""Per-sample records of a sweep: each (setting, prompt) appended to the setting's record file as
it completes, so a killed sweep resumes where it stopped (harness.sweep_engine reads them back).

A record holds the prompt's answer and what the request added to its engine's accounting (timed
regions, tokens, the ledger's sample, the attended fraction's sums, transfers), so a resumed
setting's metrics.json counts every sample once, as an uninterrupted run does; what cannot be
carried over a restart is the process's memory peak and, under runner.kv_layout=paged, the
pools' peak figures (both are the resumed process's own). The file is
`<results_root>/_sweep_records/<config hash>.jsonl` (a shard's: `<config hash>.shard-<i>-of-<n>
.jsonl`, harness.sweep_shards), one JSON line per record, flushed and synced when written; a
line cut by a kill is ignored; the file (every shard's) is removed once the setting's result
folder is written.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from harness.results import json_safe

FOLDER = "_sweep_records"
_TRANSFER_COUNTS = ("bytes_h2d", "bytes_d2h", "copies_h2d", "copies_d2h",
                    "exposed_ms_resolved", "transfer_ms_resolved")


def record_path(runner: dict[str, Any], identity: str, shard=None) -> Path:
    """The setting's record file; a shard's (harness.sweep_shards.Shard) is its own."""
    root = Path(runner.get("results_root") or "results")
    part = "" if shard is None else f".shard-{shard.index}-of-{shard.count}"
    return root / FOLDER / f"{identity}{part}.jsonl"


def prompt_key(prompt: list[int], query: list[int] | None, limit: int) -> str:
    blob = json.dumps([prompt, query, limit]).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def tally(engine) -> dict[str, Any]:
    """The engine's running accounting totals (what a request adds to)."""
    t = engine.transfers
    t.exposed_ms, t.transfer_ms  # noqa: B018 - resolve pending CUDA timings first
    return {"prefill_ms": len(engine.timer.values("prefill")),
            "decode_ms": len(engine.timer.values("decode")),
            "prefill_tokens": engine.prefill_tokens, "decode_tokens": engine.decode_tokens,
            "ledger": len(engine.ledger.samples),
            "attended": list(engine.attended.attended), "causal": list(engine.attended.causal),
            "steps": engine.attended.steps,
            "transfers": {k: getattr(t, k) for k in _TRANSFER_COUNTS},
            "h2d_per_layer": list(t.h2d_per_layer), "step_h2d": len(t.step_h2d)}


def added(engine, before: dict[str, Any]) -> dict[str, Any]:
    """What the engine's accounting gained since `before` (a `tally`)."""
    now, t = tally(engine), engine.transfers
    return {
        "prefill_ms": engine.timer.values("prefill")[before["prefill_ms"]:],
        "decode_ms": engine.timer.values("decode")[before["decode_ms"]:],
        "prefill_tokens": now["prefill_tokens"] - before["prefill_tokens"],
        "decode_tokens": now["decode_tokens"] - before["decode_tokens"],
        "ledger": engine.ledger.samples[before["ledger"]:],
        "attended": [a - b for a, b in zip(now["attended"], before["attended"])],
        "causal": [a - b for a, b in zip(now["causal"], before["causal"])],
        "steps": now["steps"] - before["steps"],
        "transfers": {k: now["transfers"][k] - before["transfers"][k] for k in _TRANSFER_COUNTS},
        "h2d_per_layer": [a - b for a, b in zip(now["h2d_per_layer"], before["h2d_per_layer"])],
        "step_h2d": t.step_h2d[before["step_h2d"]:],
    }


def apply(engine, gained: dict[str, Any]) -> None:
    """Count a recorded request in the engine's accounting, as if it had just run."""
    engine.timer.add("prefill", gained["prefill_ms"])
    engine.timer.add("decode", gained["decode_ms"])
    engine.prefill_tokens += gained["prefill_tokens"]
    engine.decode_tokens += gained["decode_tokens"]
    engine.ledger.samples.extend(gained["ledger"])
    a = engine.attended
    a.attended = [x + y for x, y in zip(a.attended, gained["attended"])]
    a.causal = [x + y for x, y in zip(a.causal, gained["causal"])]
    a.steps += gained["steps"]
    t = engine.transfers
    for k, v in gained["transfers"].items():
        setattr(t, k, getattr(t, k) + v)
    t.h2d_per_layer = [x + y for x, y in zip(t.h2d_per_layer, gained["h2d_per_layer"])]
    t.step_h2d.extend(gained["step_h2d"])


class Records:
    """One setting's record file: read back on start, appended to as samples complete."""

    def __init__(self, path: Path | None):
        self.path, self.paths = path, [] if path is None else [path]  # path None: read only
        self.done: dict[tuple[int, int, str], dict[str, Any]] = {}
        if path is not None and path.is_file():
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:  # the line a kill cut short
                    continue
                self.done[(rec["call"], rec["prompt"], rec["key"])] = rec
        self.resumed = len(self.done)

    @classmethod
    def merged(cls, paths: list[Path]) -> "Records":
        """The records of every shard of a setting, read only (the merge computes nothing).
        A sample recorded by two shards is an error, never counted twice."""
        from kvcore.errors import ConfigError

        union = cls(None)
        union.paths = list(paths)
        where: dict[tuple[int, int, str], Path] = {}
        for path in paths:
            for key, rec in cls(path).done.items():
                if key in where:
                    raise ConfigError(f"sample {key[1]} of call {key[0]} is recorded by two "
                                      f"shards ({where[key].name}, {path.name}): a shard split "
                                      "must not overlap")
                where[key] = path
                union.done[key] = rec
        union.resumed = len(union.done)
        return union

    def get(self, call: int, prompt: int, key: str) -> dict[str, Any] | None:
        return self.done.get((call, prompt, key))

    def append(self, call: int, prompt: int, key: str, output: list[int],
               gained: dict[str, Any], shared: bool = False) -> None:
        """`shared`: the answer continued from its prefill group's one prefill of the prompt."""
        rec = {"call": call, "prompt": prompt, "key": key, "output": output, "tally": gained,
               "shared": shared}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(json_safe(rec)) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.done[(call, prompt, key)] = rec

    def remove(self) -> None:
        for path in self.paths:
            path.unlink(missing_ok=True)
