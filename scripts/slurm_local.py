#!/usr/bin/env python3
"""A real one-node SLURM cluster in a folder, for tests and for trying `hydra/launcher=slurm*`
without a cluster.

    python scripts/slurm_local.py start /tmp/kvh-slurm   # prints `export SLURM_CONF=...`
    python scripts/slurm_local.py stop /tmp/kvh-slurm    # stops the daemons by their pid files

Daemons, all plain processes with their state, logs and pid files under the folder, on free
localhost ports: munged (its own key and socket), MariaDB + slurmdbd (job accounting, so `sacct`,
which submitit polls, reports cancelled and killed jobs instead of leaving them UNKNOWN),
slurmctld and slurmd. Needs root and Debian's slurm-wlm, slurmdbd, munge,
mariadb-server-core and mariadb-client-core.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PACKAGES = ("slurm-wlm", "slurmdbd", "munge", "mariadb-server-core", "mariadb-client-core")
BINARIES = ("slurmctld", "slurmd", "slurmdbd", "munged", "mungekey", "mariadbd",
            "mariadb-install-db", "my_print_defaults", "sbatch", "sacct", "scontrol", "sinfo", "sacctmgr")
CLUSTER = "kvh"
PARTITION = "debug"
MUNGE_RUN = "/run/munge"
# Stop order: the node, the controller, accounting, its database, then authentication.
DAEMONS = ("slurmd", "slurmctld", "slurmdbd", "mariadb", "munged")


class ClusterError(RuntimeError):
    pass


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], env: dict | None = None, timeout: float = 60) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise ClusterError(f"{' '.join(cmd[:2])} failed ({proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()[-800:]}")
    return proc.stdout


def _mem_total_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    raise ClusterError("cannot read MemTotal from /proc/meminfo")


def client_env(root: Path) -> dict[str, str]:
    """The environment SLURM's client commands (sbatch, sacct, ...) need to reach this cluster."""
    return {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.write_text(text)
    path.chmod(mode)


def _configs(root: Path, ports: dict[str, int], node: str, cpus: int, mem_mb: int) -> None:
    auth = "AuthType=auth/munge\n"
    _write(root / "slurmdbd.conf", f"""{auth}DbdHost=localhost
DbdPort={ports['slurmdbd']}
SlurmUser=root
PidFile={root}/pid/slurmdbd.pid
LogFile={root}/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={ports['mariadb']}
StorageUser=root
StorageLoc=slurm_acct_db
""", 0o600)  # slurmdbd refuses a config others can read (it holds storage credentials)
    _write(root / "slurm.conf", f"""ClusterName={CLUSTER}
SlurmctldHost={node}
SlurmctldPort={ports['slurmctld']}
SlurmdPort={ports['slurmd']}
SlurmUser=root
SlurmdUser=root
{auth}StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/pid/slurmctld.pid
SlurmdPidFile={root}/pid/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
MailProg=/bin/true
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# An over-large request is refused at sbatch time instead of pending forever.
EnforcePartLimits=ALL
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort={ports['slurmdbd']}
NodeName={node} CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN
PartitionName={PARTITION} Nodes={node} Default=YES MaxTime=INFINITE State=UP
""")


def _wait(what: str, check, timeout_s: float, log: Path | None = None) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if check():
            return
        time.sleep(0.2)
    tail = ""
    if log is not None and log.exists():
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-5:])
    raise ClusterError(f"{what} not ready after {timeout_s:.0f} s{': ' + tail if tail else ''}")


def _ok(cmd: list[str], env: dict | None = None) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=10, env=env).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def start(root: Path, cpus: int | None = None, mem_mb: int | None = None) -> dict[str, str]:
    """Start every daemon and wait until the node is idle and accounting answers.
    Returns the client environment. On failure, whatever started is stopped again."""
    if os.geteuid() != 0:
        raise ClusterError("the local cluster runs its daemons as root (SlurmUser=root); run as root")
    missing = missing_binaries()
    if missing:
        raise ClusterError(f"missing {', '.join(missing)}: apt-get install {' '.join(PACKAGES)}")
    root = root.resolve()
    for sub in ("munge", "db", "state", "spool", "pid", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "munge").chmod(0o700)
    node = socket.gethostname().split(".")[0]
    cpus = cpus or os.cpu_count() or 1
    mem_mb = mem_mb or min(8000, _mem_total_mb() // 2)
    ports = {k: _free_port() for k in ("slurmctld", "slurmd", "slurmdbd", "mariadb")}
    _configs(root, ports, node, cpus, mem_mb)
    env = client_env(root)
    try:
        _start_munge(root)
        _start_mariadb(root, ports["mariadb"])
        _run(["slurmdbd"], env)  # reads slurmdbd.conf next to $SLURM_CONF
        _wait("slurmdbd", lambda: _ok(["sacctmgr", "-n", "list", "cluster"], env), 60,
              root / "log" / "slurmdbd.log")
        # Registering the cluster first makes slurmctld's accounting work from its first job.
        if CLUSTER not in _run(["sacctmgr", "-n", "-P", "list", "cluster", "format=cluster"], env):
            _run(["sacctmgr", "-i", "add", "cluster", CLUSTER], env)
        _run(["slurmctld", "-i"], env)
        _run(["slurmd"], env)
        _wait("the node", lambda: _node_state(env) == "idle", 60, root / "log" / "slurmd.log")
    except BaseException:
        stop(root)
        raise
    return env


def _start_munge(root: Path) -> None:
    """munged on its default socket: SLURM 22.05's accounting connections ignore AuthInfo=socket=,
    so every daemon and client must find munged there. One that already answers is reused."""
    if _ok(["sh", "-c", "munge -n | unmunge"]):
        return
    key = root / "munge" / "munge.key"
    if not key.exists():
        _run(["mungekey", "--create", f"--keyfile={key}"])
    key.chmod(0o600)
    Path(MUNGE_RUN).mkdir(parents=True, exist_ok=True)
    _run(["munged", f"--key-file={key}", f"--pid-file={root}/pid/munged.pid",
          f"--log-file={root}/log/munged.log", f"--seed-file={root}/munge/munged.seed", "--force"])
    _wait("munged", lambda: _ok(["sh", "-c", "munge -n | unmunge"]), 20,
          root / "log" / "munged.log")


def _start_mariadb(root: Path, port: int) -> None:
    data = root / "db"
    if not (data / "mysql").is_dir():
        _run(["mariadb-install-db", "--no-defaults", f"--datadir={data}", "--user=root",
              "--skip-test-db", "--auth-root-authentication-method=normal"], timeout=120)
    log = root / "log" / "mariadb.log"
    # Bound to 127.0.0.1 only, in a temp folder: no grant tables needed for slurmdbd's root login.
    subprocess.Popen(["mariadbd", "--no-defaults", f"--datadir={data}", "--user=root",
                      f"--port={port}", "--bind-address=127.0.0.1", f"--socket={root}/db.sock",
                      f"--pid-file={root}/pid/mariadb.pid", f"--log-error={log}",
                      "--skip-grant-tables", "--innodb-buffer-pool-size=32M"],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True)

    def up() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return (root / "pid" / "mariadb.pid").exists()
        except OSError:
            return False

    _wait("MariaDB", up, 60, log)


def _node_state(env: dict) -> str:
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                             timeout=10, env=env).stdout
    except subprocess.TimeoutExpired:
        return ""
    return out.strip()


def _alive(pid: int) -> bool:
    """Running (a zombie counts as stopped: without an init nobody reaps a daemon's pid)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def daemon_pids(root: Path) -> dict[str, int]:
    pids = {}
    for name in DAEMONS:
        path = root / "pid" / f"{name}.pid"
        try:
            pids[name] = int(path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return pids


def running(root: Path) -> dict[str, int]:
    return {name: pid for name, pid in daemon_pids(root).items() if _alive(pid)}


def stop(root: Path, timeout_s: float = 20) -> None:
    """SIGTERM each daemon by its pid file (node first), SIGKILL after timeout_s; pid files removed."""
    for name, pid in daemon_pids(Path(root)).items():
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.time() + timeout_s
            while _alive(pid) and time.time() < deadline:
                time.sleep(0.1)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
            _reap(pid)
        (Path(root) / "pid" / f"{name}.pid").unlink(missing_ok=True)


def _reap(pid: int) -> None:
    """Collect the exit status of a daemon we started ourselves (mariadbd), so it leaves no zombie."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not our child (the SLURM daemons fork away)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("start", "stop", "status"))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--cpus", type=int, default=None, help="CPUs of the node (default: all)")
    parser.add_argument("--mem-mb", type=int, default=None,
                        help="RealMemory of the node in MB (default: half of RAM, at most 8000)")
    args = parser.parse_args()
    try:
        if args.action == "start":
            start(args.folder, args.cpus, args.mem_mb)
            print(f"export SLURM_CONF={args.folder.resolve()}/slurm.conf "
                  f"KVH_SLURM_PARTITION={PARTITION}")
        elif args.action == "stop":
            stop(args.folder)
        else:
            alive = running(args.folder)
            print(" ".join(f"{k}={v}" for k, v in alive.items()) or "stopped")
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
