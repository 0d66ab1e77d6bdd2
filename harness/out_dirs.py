"""The regression gate's output folder (`make gate`): emptied before the gate's sweeps write into
it, only when everything in it is the harness's own output.

    GATE_DIR=results/ci_gate python -m harness.gate_dir      # what `make gate` runs first

The folder comes from the environment (`GATE_DIR`, as make passes it; default results/ci_gate)
or an argument, and is checked like a CLI output path: a link is refused (never followed out),
as is a file, and a folder holding anything the harness did not write (a user's file, a link, a
run folder with a file of someone else's). What the harness writes there: run folders
(`harness.results.RUN_FILES` and a valid metrics.json), sweep folders (their `SWEEP_MARK`),
staging folders of killed runs (their `STAGING_MARK`) and the folders above them. Exit 2 with
one `error:` line naming the variable when refused; nothing is changed then.
"""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import sys
from pathlib import Path

from kvcore.errors import ConfigError

ENV = "GATE_DIR"
DEFAULT = Path("results") / "ci_gate"
_SHOWN = 3  # foreign entries named in the message


def _owned_marker(folder: Path) -> bool:
    """A sweep or staging folder of this harness: its mark, a regular file, is in it."""
    from harness.results import STAGING_MARK
    from harness.sweep import SWEEP_MARK

    return any(stat.S_ISREG(os.lstat(folder / mark).st_mode) for mark in (SWEEP_MARK,
                                                                          STAGING_MARK)
               if os.path.lexists(folder / mark))


def foreign(folder: Path, top: Path | None = None) -> list[str]:
    """Paths (relative to `top`) under `folder` the harness did not write; links are never
    followed (a link is itself foreign: the harness writes none)."""
    from harness.results import not_ours

    top = top or folder
    out = []
    for entry in sorted(folder.iterdir()):
        name = str(entry.relative_to(top))
        mode = os.lstat(entry).st_mode
        if not stat.S_ISDIR(mode):  # a file outside a run folder, a link, a FIFO
            out.append(name)
        elif _owned_marker(entry):
            continue
        elif (entry / "metrics.json").is_file() and not (entry / "metrics.json").is_symlink():
            why = not_ours(entry)
            if why:
                out.append(f"{name} ({why})")
        else:
            out += foreign(entry, top)
        if len(out) >= _SHOWN:
            break
    return out


def prepare(folder: Path, key: str) -> Path:
    """Empty `folder` for a new gate (create it when absent); ConfigError naming `key` when it is
    a link, a file, or holds anything the harness did not write. Returns the folder."""
    from harness.results import check_writable

    if folder.is_symlink():
        raise ConfigError(f"{key}: {folder} is a link (to {os.path.realpath(folder)}); the gate "
                          "writes only into a folder of its own, never through a link. Give a "
                          "folder path")
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{key}: {folder} is a file, not a folder; nothing was changed")
    if folder.is_dir():
        held = foreign(folder)
        if held:
            raise ConfigError(f"{key}: {folder} holds files the harness did not write "
                              f"({', '.join(held)}{' ...' if len(held) >= _SHOWN else ''}); "
                              "nothing was changed. Choose a new or empty folder, or an "
                              "earlier gate's")
        shutil.rmtree(folder)
    check_writable(folder, key)
    folder.mkdir(parents=True)
    return folder


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.gate_dir",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("folder", nargs="?", type=Path, default=None,
                    help=f"the gate's output folder (default ${ENV}, else {DEFAULT})")
    args = ap.parse_args(argv)
    given = os.environ.get(ENV)
    if args.folder is not None:
        folder, key = args.folder, str(args.folder)
    elif given is not None:
        if not given.strip():
            print(f"error: {ENV}='{given}' is empty; give the gate's output folder",
                  file=sys.stderr)
            return 2
        folder, key = Path(given), f"{ENV}={given}"
    else:
        folder, key = DEFAULT, f"{ENV} (default {DEFAULT})"
    try:
        prepare(folder, key)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # permissions while emptying it
        print(f"error: {key}: cannot empty {folder} ({exc.strerror or exc})", file=sys.stderr)
        return 2
    print(f"gate output folder: {folder} (empty)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
