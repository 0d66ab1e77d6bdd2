"""Offline lm-eval task YAMLs: templates in `tasks/lm_eval_tasks/`, real YAMLs in a cache folder.

lm-eval needs absolute data paths (Hydra may change the working directory) and its own task
folder for `include:`, neither of which the project may hard-code. `offline_task_dir(data_dir)`
fills both into the templates and writes the result, with `utils.py` and a `kvh_paths.json`, into
`<cache>/lm_eval_tasks/<content hash>/` (atomically: temp folder + rename). A folder whose files do
not match what would be written is rewritten. Pass the returned folder to lm-eval:

    python -m harness.lm_eval --model kvharness --model_args model=stories260k,method=full \
        --tasks copa --include_path "$(python -m harness.lm_eval.tasks)" --limit 10

Task names are lm-eval's standard ones; lm-eval lets an `--include_path` task override a built-in
of the same name (with a warning), so `--tasks copa` runs ours whenever the folder is included.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from kvcore.errors import ConfigError
from harness.core.models import PROJECT_ROOT, SHARED_DIR, default_cache_dir

TEMPLATE_DIR = PROJECT_ROOT / "tasks" / "lm_eval_tasks"
TEMPLATE_SUFFIX = ".yaml.in"
UTILS_FILE = "utils.py"
PATHS_FILE = "kvh_paths.json"  # read by utils.data_dir()
# task name -> the local files it reads, relative to the data folder
TASK_FILES: dict[str, tuple[str, ...]] = {
    "copa": ("copa/copa.jsonl",),
    "piqa": ("piqa/dev.jsonl", "piqa/dev-labels.lst"),
    "openbookqa": ("openbookqa/openbook_qa.jsonl",),
    "winogrande": ("winogrande/winogrande.jsonl",),
    "rte": ("rte/val.jsonl",),
    "lambada_openai": ("lambada/lambada_openai.jsonl",),
}
INFINIGEN_TASKS = ("copa", "openbookqa", "winogrande", "piqa", "rte")  # the paper's five


def default_data_dir() -> Path:
    return SHARED_DIR / "data"


def lm_eval_tasks_root() -> Path:
    """lm-eval's own task folder (located without importing lm-eval)."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or spec.origin is None:
        raise ConfigError("the lm-eval package is not installed (pip install lm-eval==0.4.13)")
    return Path(spec.origin).parent / "tasks"


def resolve_data_dir(data_dir: str | os.PathLike | None, key: str = "task.data_dir") -> Path:
    path = Path(data_dir).expanduser() if data_dir else default_data_dir()
    if not path.is_dir():
        raise ConfigError(f"{key}={path}: no such folder (the local copies of the lm-eval task "
                          "data; default ../shared/data from the project root)")
    return path.resolve()


def check_task_data(names: list[str], data_dir: str | os.PathLike | None,
                    key: str = "task.data_dir") -> Path:
    """Fail early, naming the file, when a task's local data is missing. Returns the folder."""
    folder = resolve_data_dir(data_dir, key)
    for name in names:
        if name not in TASK_FILES:
            raise ConfigError(f"task.names: {name!r} has no offline copy; allowed: "
                              f"{', '.join(TASK_FILES)}")
        for rel in TASK_FILES[name]:
            if not (folder / rel).is_file():
                raise ConfigError(f"{key}={folder}: {rel} is missing (needed by lm-eval task "
                                  f"{name!r}; see ../shared/data/SOURCES.md)")
    return folder


def _yaml_string_body(path: Path) -> str:
    """`path` escaped for the inside of a double-quoted YAML (= JSON) string."""
    return json.dumps(str(path))[1:-1]


def render_files(data_dir: Path) -> dict[str, bytes]:
    """Every file of the offline task folder, by name, for this data folder and lm-eval install."""
    lm_tasks = lm_eval_tasks_root()
    files: dict[str, bytes] = {}
    for template in sorted(TEMPLATE_DIR.glob("*" + TEMPLATE_SUFFIX)):
        text = template.read_text(encoding="utf-8")
        include = text.split('include: "@LM_EVAL_TASKS@/', 1)[-1].split('"', 1)[0]
        if not (lm_tasks / include).is_file():
            raise ConfigError(f"{template}: includes {include}, which lm-eval "
                              f"({lm_tasks}) does not ship; is lm-eval 0.4.13 installed?")
        text = (text.replace("@LM_EVAL_TASKS@", _yaml_string_body(lm_tasks))
                    .replace("@DATA_DIR@", _yaml_string_body(data_dir)))
        files[template.name[: -len(TEMPLATE_SUFFIX)] + ".yaml"] = text.encode("utf-8")
    missing = sorted(set(TASK_FILES) - {name[:-5] for name in files})
    if missing:
        raise ConfigError(f"{TEMPLATE_DIR}: no template for {', '.join(missing)}")
    files[UTILS_FILE] = (TEMPLATE_DIR / UTILS_FILE).read_bytes()
    files[PATHS_FILE] = json.dumps({"data_dir": str(data_dir)}, indent=1).encode("utf-8")
    return files


def _matches(folder: Path, files: dict[str, bytes]) -> bool:
    try:
        present = {p.name for p in folder.iterdir() if p.is_file()}
        return present == set(files) and all((folder / n).read_bytes() == b
                                              for n, b in files.items())
    except OSError:
        return False


def offline_task_dir(data_dir: str | os.PathLike | None = None,
                     cache_dir: str | os.PathLike | None = None,
                     key: str = "task.data_dir") -> Path:
    """The folder of generated offline task YAMLs for `data_dir` (written if missing or stale).

    `key` names the setting `data_dir` came from, for the error message.
    """
    data = resolve_data_dir(data_dir, key)
    files = render_files(data)
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name] + b"\0")
    root = Path(cache_dir) if cache_dir else default_cache_dir() / "lm_eval_tasks"
    folder = root / digest.hexdigest()[:16]
    if _matches(folder, files):
        return folder
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=root))
    try:
        for name, data_bytes in files.items():
            (tmp / name).write_bytes(data_bytes)
        if folder.exists():
            shutil.rmtree(folder, ignore_errors=True)
        try:
            os.replace(tmp, folder)
        except OSError:
            if not _matches(folder, files):  # another process won the race with other content
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m harness.lm_eval.tasks",
        description="Write (if needed) and print the folder of offline lm-eval task YAMLs, "
                    "for lm-eval's --include_path.")
    parser.add_argument("--data_dir", default=None,
                        help="folder with the local data copies (default: ../shared/data)")
    parser.add_argument("--cache_dir", default=None,
                        help="where generated folders live "
                             "(default: <kv-harness cache>/lm_eval_tasks)")
    args = parser.parse_args(argv)
    try:
        print(offline_task_dir(args.data_dir, args.cache_dir, key="--data_dir"))
    except ConfigError as exc:
        raise SystemExit(f"error: {exc}") from None


if __name__ == "__main__":
    main()
