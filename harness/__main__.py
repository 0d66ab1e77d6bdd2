"""`python -m harness model=... method=... task=...` (Hydra)."""

import os
import re
import signal
import sys

# Before torch loads: OpenMP's active spin-wait makes 2-core machines ~25x slower under any
# contention (2.1 s/step instead of 85 ms measured). A user's explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hydra  # noqa: E402
from hydra.errors import HydraException  # noqa: E402
from omegaconf import DictConfig  # noqa: E402
from omegaconf.errors import OmegaConfBaseException  # noqa: E402

from harness import CONF_DIR  # noqa: E402
from harness.config.config_check import struct_hint  # noqa: E402
from harness.run import main_guarded  # noqa: E402
from harness.config.multirun import discard_claimed  # noqa: E402
from kvcore.errors import ConfigError  # noqa: E402
from kvcore.guards import request_stop  # noqa: E402
from methods.kernels.cpu_build import check_environment as check_kernel_environment  # noqa: E402

BAD_INPUT_EXIT = 2
DEBUG = re.compile(r"\+{0,2}runner\.debug=(true|True|TRUE|yes|1)")


def _stop(signum, frame):
    """SIGINT and SIGTERM unwind like Ctrl-C: staging removed, nothing partial. The request is
    also recorded, so storage writes raise it again should Python drop this one (a signal that
    lands inside a finalizer): kvcore.guards."""
    request_stop()
    raise KeyboardInterrupt


def install_signal_handlers() -> None:
    """Ctrl-C and SIGTERM both unwind through the run's cleanup. SIGINT is installed explicitly:
    a process started with SIGINT ignored (`nohup ... &`, some CI runners) inherits the ignore and
    Python then leaves it ignored."""
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    main_guarded(cfg)


def one_line(exc: BaseException) -> str:
    """Hydra's multi-line messages as one line; `_`-prefixed fragments are never offered."""
    raw = str(exc).splitlines()
    lines = [ln.strip() for ln in raw if ln.strip()
             and not ln.strip().startswith(("See https://", "Set the environment"))]
    if not lines:
        return type(exc).__name__
    hint = struct_hint(f"{exc}\n{exc.__cause__ or ''}", sys.argv[1:])
    if hint:  # "Key 'x' is not in struct": ours, naming the closest key (never `+key`)
        return hint
    head = lines[0].removeprefix("In 'config': ")
    override = getattr(exc, "override", None)  # OverrideParseException
    if override:
        head = f"override {override!r} cannot be parsed: {head}"
        key, _, value = str(override).partition("=")
        if value and value[0] not in "'\"":
            head += f" (quote the value: {key}='{value}')"
    for i, line in enumerate(raw):
        if line.strip().startswith("Available options"):
            options = []
            for option in raw[i + 1:]:
                if not option.startswith("\t"):
                    break
                if not option.strip().startswith("_"):
                    options.append(option.strip())
            return f"{head}; allowed: {', '.join(options)}"
    text = ": ".join([head, *lines[1:2]])
    cause = exc.__cause__
    if cause is not None and str(cause).strip() and str(cause).splitlines()[0] not in text:
        text += f": {str(cause).strip().splitlines()[0]}"
    return text


def register_launchers() -> None:
    """The project's own Hydra launchers (conf/hydra/launcher), registered by class: Hydra finds
    plugins by listing the `hydra_plugins` namespace, which an editable install's import hook
    does not list (`Unknown plugin class` for a multirun run outside the checkout)."""
    import importlib

    from hydra.core.plugins import Plugins

    for module, name in (("hydra_plugins.kvh_sweep.sweep_launcher", "SweepLauncher"),
                         ("hydra_plugins.kvh_slurm.slurm_launcher", "SlurmLauncher"),
                         ("hydra_plugins.kvh_rounds.rounds_sweeper", "RoundsSweeper")):
        try:  # an install made before the plugin shipped: single runs still work
            Plugins.instance().register(getattr(importlib.import_module(module), name))
        except ImportError:
            continue


def cli() -> None:
    """Hydra-level errors (unknown group option, override syntax, a refused sweep) print one line
    and exit 2, like the runner's own; HYDRA_FULL_ERROR=1 or runner.debug=true show tracebacks."""
    install_signal_handlers()
    full = os.environ.get("HYDRA_FULL_ERROR") == "1" or any(
        DEBUG.fullmatch(arg) for arg in sys.argv[1:])
    if full:
        os.environ["KVH_FULL_ERROR"] = "1"  # the runner's errors too (harness.run), and members'
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises instead of printing its own report
    register_launchers()
    try:
        check_kernel_environment()  # $KVH_KERNEL_FLAGS/$KVH_KERNEL_CACHE: before anything loads
        main()
    except (HydraException, OmegaConfBaseException, ConfigError) as exc:
        discard_claimed()  # a sweep refused after its folder was made leaves nothing behind
        if full:
            raise
        print(f"error: {one_line(exc)}", file=sys.stderr)
        sys.exit(BAD_INPUT_EXIT)


if __name__ == "__main__":
    cli()
