"""The folders `make` targets empty and write into, named by environment variables: emptied only
when everything in them is what that target writes.

    GATE_DIR=results/ci_gate python -m harness.store.out_dirs GATE_DIR      # `make gate`, first step
    PARITY_DIR=results/parity python -m harness.store.out_dirs PARITY_DIR    # `make parity`, first step

Each variable (as make passes it; its default otherwise) is checked like a CLI output path: a
link is refused (never followed out), as is a file, and a folder holding anything the target did
not write (a user's file, a link, a FIFO, a run folder with someone else's file in it):

* GATE_DIR: a results tree: run folders (`harness.store.results.RUN_FILES` and a valid metrics.json),
  sweep folders (their `SWEEP_MARK`), staging folders of killed runs (their `STAGING_MARK`) and
  the folders above them;
* PARITY_DIR: the parity files (`PARITY_FILES`: benchmarks/parity.py and scripts/kvpress_peer.py
  write them), as regular files.

Refused: exit 2 with one `error:` line naming the variable; nothing is changed then.
"""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import sys
from pathlib import Path
from typing import Callable

from kvcore.errors import ConfigError

_SHOWN = 3  # foreign entries named in the message
# What `make parity` writes into PARITY_DIR (benchmarks/parity.py ours, scripts/kvpress_peer.py),
# and the temporary names its atomic writes use on the way.
PARITY_FILES = frozenset({"prompts.json", "ours.json", "peer.json", "qfilters.safetensors",
                          "prompts.json.tmp", "ours.json.tmp", "peer.json.tmp",
                          "qfilters.tmp"})


def _owned_marker(folder: Path) -> bool:
    """A sweep or staging folder of this harness: its mark, a regular file, is in it."""
    from harness.store.results import STAGING_MARK, SWEEP_MARK

    return any(os.path.lexists(folder / mark) and stat.S_ISREG(os.lstat(folder / mark).st_mode)
               for mark in (SWEEP_MARK, STAGING_MARK))


def results_foreign(folder: Path, top: Path | None = None) -> list[str]:
    """Paths (relative to `top`) under a results tree that no run or sweep of the harness wrote;
    links are never followed (a link is itself foreign: the harness writes none)."""
    from harness.store.results import not_ours

    top = top or folder
    out = []
    for entry in sorted(folder.iterdir()):
        name = str(entry.relative_to(top))
        if not stat.S_ISDIR(os.lstat(entry).st_mode):  # a file outside a run, a link, a FIFO
            out.append(name)
        elif _owned_marker(entry):
            continue
        elif (entry / "metrics.json").is_file() and not (entry / "metrics.json").is_symlink():
            why = not_ours(entry)
            if why:
                out.append(f"{name} ({why})")
        else:
            out += results_foreign(entry, top)
        if len(out) >= _SHOWN:
            break
    return out


def parity_foreign(folder: Path) -> list[str]:
    """Entries of a parity folder that are not the parity files, as regular files."""
    return [entry.name for entry in sorted(folder.iterdir())
            if entry.name not in PARITY_FILES or not stat.S_ISREG(os.lstat(entry).st_mode)
            ][:_SHOWN]


# variable -> (its default, what decides the folder's entries are the target's own)
FOLDERS: dict[str, tuple[Path, Callable[[Path], list[str]]]] = {
    "GATE_DIR": (Path("results") / "ci_gate", results_foreign),
    "PARITY_DIR": (Path("results") / "parity", parity_foreign),
}


def prepare(folder: Path, key: str, foreign: Callable[[Path], list[str]]) -> Path:
    """Empty `folder` (create it when absent); ConfigError naming `key` when it is a link, a
    file, or holds anything `foreign` names. Returns the folder."""
    from harness.store.results import check_writable

    if folder.is_symlink():
        raise ConfigError(f"{key}: {folder} is a link (to {os.path.realpath(folder)}); make "
                          "writes only into a folder of its own, never through a link. Give a "
                          "folder path")
    if folder.exists() and not folder.is_dir():
        kind = "a FIFO" if stat.S_ISFIFO(os.stat(folder).st_mode) else "a file"
        raise ConfigError(f"{key}: {folder} is {kind}, not a folder; nothing was changed")
    if folder.is_dir():
        held = foreign(folder)
        if held:
            raise ConfigError(f"{key}: {folder} holds files the harness did not write "
                              f"({', '.join(held)}{' ...' if len(held) >= _SHOWN else ''}); "
                              "nothing was changed. Choose a new or empty folder, or one this "
                              "target wrote before")
        shutil.rmtree(folder)
    check_writable(folder, key)
    folder.mkdir(parents=True)
    return folder


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.store.out_dirs",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("variable", choices=sorted(FOLDERS),
                    help="the environment variable naming the folder (its default when unset)")
    args = ap.parse_args(argv)
    default, foreign = FOLDERS[args.variable]
    given = os.environ.get(args.variable)
    if given is not None and not given.strip():
        print(f"error: {args.variable}='{given}' is empty; give the target's output folder",
              file=sys.stderr)
        return 2
    folder = Path(given) if given is not None else default
    key = f"{args.variable}={given}" if given is not None else f"{args.variable} ({default})"
    try:
        prepare(folder, key, foreign)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # permissions while emptying it
        print(f"error: {key}: cannot empty {folder} ({exc.strerror or exc})", file=sys.stderr)
        return 2
    print(f"{args.variable}: {folder} (empty)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
