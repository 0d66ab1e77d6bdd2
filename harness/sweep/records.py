"""Per-sample records of a sweep: each (setting, prompt) appended to the setting's record file as
it completes, so a killed sweep resumes where it stopped (harness.sweep.execute reads them back).

A record holds the prompt's answer and what the request added to its engine's accounting (timed
regions, tokens, the ledger's sample, the attended fraction's sums, transfers), so a resumed
setting's metrics.json counts every sample once, as an uninterrupted run does; a second line
per prompt, written once the prompt's paired fidelity is made (`task.fidelity_tokens`, made in
the answers' pass), holds the setting's fidelity record, so a resumed prompt whose every
setting has both is neither prefilled nor teacher-forced again; what cannot be
carried over a restart is the process's memory peak and, under runner.kv_layout=paged, the
pools' peak figures (both are the resumed process's own). The file is
`<results_root>/_sweep_records/<config hash>.jsonl` (a shard's: `<config hash>.shard-<i>-of-<n>
.jsonl`, harness.sweep.shards), one JSON line per record, flushed and synced when written; a
line cut by a kill is dropped; the file (every shard's) is removed once the setting's result
folder is written.

Records prove what they hold: the file's first line names the setting that writes it (config
hash, method, label, shard) and every record repeats the config hash and names its prompt (a
hash of its token ids); a file of another setting or split, a malformed line, or a link is
refused with one line naming the file, never merged or resumed silently, and record files of a
sweep split otherwise are named before work (`strays`).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.store.schema import json_safe
from kvcore.errors import ConfigError

if TYPE_CHECKING:
    from harness.config.runner import RunnerSettings

FOLDER = "_sweep_records"
_TRANSFER_COUNTS = ("bytes_h2d", "bytes_d2h", "copies_h2d", "copies_d2h",
                    "exposed_ms_resolved", "transfer_ms_resolved")


def record_path(runner: RunnerSettings, identity: str, shard=None) -> Path:
    """The setting's record file; a shard's (harness.sweep.shards.Shard) is its own."""
    root = Path(runner.results_root)
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


# The first line of every record file: whose records these are. A file without it, or of
# another setting or split, is refused by name, never resumed or merged.
KIND = "kv-harness sweep records"
VERSION = 2
_FIELDS = {"call": int, "prompt": int, "key": str, "output": list, "tally": dict, "shared": bool}
_FIDELITY_FIELDS = {"call": int, "prompt": int, "key": str, "fidelity": dict}


def owner(setting, shard=None) -> dict[str, Any]:
    """What a record file names as its writer: the setting's config hash, method and label, and
    the shard ("i/n", 0-based) or None."""
    return {"identity": setting.identity, "method": setting.method_name,
            "setting": setting.label,
            "shard": None if shard is None else f"{shard.index}/{shard.count}"}


def _refuse(path: Path, why: str) -> ConfigError:
    return ConfigError(f"sweep records {path}: {why}; remove the file to answer the setting's "
                       "samples anew")


def _read_lines(path: Path) -> list[str]:
    """The file's complete lines (opened without following a link; a line cut by a kill is
    dropped from the file, so the next record starts on a line of its own)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO never waits
    except FileNotFoundError:
        return []
    except OSError as exc:  # ELOOP: a link (the project never writes its records as one)
        raise _refuse(path, "is a link or cannot be opened (" + (exc.strerror or str(exc))
                      + ")") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _refuse(path, "is not a regular file")
    with os.fdopen(fd, "r+b") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):  # the line a kill cut short
            f.truncate(end)
    try:
        return data[:end].decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise _refuse(path, "is not UTF-8 text (not a record file)") from None


def _record(path: Path, number: int, line: str, identity: str) -> dict[str, Any]:
    try:
        rec = json.loads(line)
    except ValueError:
        raise _refuse(path, f"line {number} is not JSON") from None
    if not isinstance(rec, dict):
        raise _refuse(path, f"line {number} is a JSON {type(rec).__name__}, not a record")
    if rec.get("identity") != identity:
        raise _refuse(path, f"line {number} is a record of setting {rec.get('identity')!r}, "
                      f"not of {identity}")
    for name, kind in (_FIDELITY_FIELDS if "fidelity" in rec else _FIELDS).items():
        if not isinstance(rec.get(name), kind) or (kind is int and isinstance(rec[name], bool)):
            raise _refuse(path, f"line {number} has no valid {name!r} ({kind.__name__})")
    return rec


class Records:
    """One setting's record file: read back on start (every line checked to be this setting's),
    appended to as samples complete."""

    def __init__(self, path: Path | None, writer: dict[str, Any] | None = None):
        """`writer`: the setting (and shard) that owns the file (`owner`); `path` None: none."""
        self.path, self.paths = path, [] if path is None else [path]
        self.writer = writer
        self.done: dict[tuple[int, int, str], dict[str, Any]] = {}
        self.fidelity: dict[tuple[int, int, str], dict[str, Any]] = {}  # where -> its record
        self.resumed = 0
        if path is None:
            return
        lines = _read_lines(path)
        if lines:
            self._check_header(lines[0])
            for number, line in enumerate(lines[1:], 2):
                rec = _record(path, number, line, writer["identity"])
                where = (rec["call"], rec["prompt"], rec["key"])
                if "fidelity" in rec:
                    self.fidelity[where] = rec["fidelity"]
                else:
                    self.done[where] = rec
        self.resumed = len(self.done)

    def _check_header(self, line: str) -> None:
        try:
            head = json.loads(line)
        except ValueError:
            head = None
        if not isinstance(head, dict) or head.get("kind") != KIND:
            raise _refuse(self.path, "its first line does not say it holds kv-harness sweep "
                          "records (a file the project did not write, or an older format)")
        if head.get("version") != VERSION:
            raise _refuse(self.path, f"format version {head.get('version')!r}, this harness "
                          f"reads {VERSION}")
        theirs = {k: head.get(k) for k in ("identity", "shard")}
        if theirs != {k: self.writer[k] for k in ("identity", "shard")}:
            raise _refuse(self.path, f"it holds the records of {head.get('setting')!r} (config "
                          f"{head.get('identity')}, shard {head.get('shard')}), not of "
                          f"{self.writer['setting']} (config {self.writer['identity']}, shard "
                          f"{self.writer['shard']})")

    @classmethod
    def merged(cls, paths: list[Path], writers: list[dict[str, Any]]) -> "Records":
        """The records of every shard of a setting, read only (the merge computes nothing).
        A sample recorded by two shards is an error, never counted twice."""
        union = cls(None)
        union.paths = list(paths)
        where: dict[tuple[int, int, str], Path] = {}
        for path, writer in zip(paths, writers):
            for key, rec in cls(path, writer).done.items():
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

    def fidelity_of(self, call: int, prompt: int, key: str) -> dict[str, Any] | None:
        return self.fidelity.get((call, prompt, key))

    def append(self, call: int, prompt: int, key: str, output: list[int],
               gained: dict[str, Any], shared: bool = False) -> None:
        """`shared`: the answer continued from its prefill group's one prefill of the prompt."""
        rec = {"identity": self.writer["identity"], "call": call, "prompt": prompt, "key": key,
               "output": output, "tally": gained, "shared": shared}
        self._write(rec)
        self.done[(call, prompt, key)] = rec

    def append_fidelity(self, call: int, prompt: int, key: str, record: dict[str, Any]) -> None:
        """The prompt's paired fidelity record of this setting (harness.core.fidelity), as
        read back: what a resumed sweep takes instead of making it again."""
        line = self._write({"identity": self.writer["identity"], "call": call, "prompt": prompt,
                            "key": key, "fidelity": record})
        self.fidelity[(call, prompt, key)] = json.loads(line)["fidelity"]

    def _write(self, rec: dict[str, Any]) -> str:
        """One line appended (after the file's header, written first), flushed and synced;
        returns the line as written."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lines = [] if self.done or self.fidelity or self._started() else [
            json.dumps({"kind": KIND, "version": VERSION, **self.writer})]
        line = json.dumps(json_safe(rec))
        lines.append(line)
        try:  # never through a link: a records file planted as one must not reach its target
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                         | os.O_NONBLOCK, 0o644)
        except OSError as exc:
            raise _refuse(self.path, "cannot be appended to (" + (exc.strerror or str(exc))
                          + "; a link is never followed)") from None
        with os.fdopen(fd, "a") as f:
            f.write("".join(text + "\n" for text in lines))
            f.flush()
            os.fsync(f.fileno())
        return line

    def _started(self) -> bool:
        """Whether the file already has its header (records, if any, follow it)."""
        try:
            return os.stat(self.path, follow_symlinks=False).st_size > 0
        except FileNotFoundError:
            return False

    def remove(self) -> None:
        for path in self.paths:
            path.unlink(missing_ok=True)


def strays(runner: RunnerSettings, identity: str, count: int) -> list[Path]:
    """Record files of this setting that a sweep split into `count` shards (1: unsharded) would
    neither resume nor merge: those of a sweep split otherwise (a killed one), named before
    work so they are not left to be resumed later by surprise."""
    folder = record_path(runner, identity).parent
    if not folder.is_dir():
        return []
    ours = {record_path(runner, identity).name} if count == 1 else {
        f"{identity}.shard-{i}-of-{count}.jsonl" for i in range(count)}
    return sorted(p for p in folder.glob(f"{identity}*.jsonl") if p.name not in ours)
