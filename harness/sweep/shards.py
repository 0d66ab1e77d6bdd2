"""Shards: the samples of a sweep split over processes (or SLURM array tasks), each shard
answering its samples for every setting, then one merge writing each setting's result.

`runner.shards=n` splits every `generate` request of the task (its list of samples) into n
contiguous blocks: prompt i of N belongs to shard i*n // N. The split depends on the sample's
index alone, so every setting gets the same samples in a shard and the union of the shards is
the whole task; the tasks order their samples round-robin over their cells (RULER's sub-task x
length x depth, LongBench's one call per dataset), so a contiguous block holds every cell in
proportion. A shard appends each (setting, sample) answer to its own record file
(harness.sweep.records); the merge is a sweep whose every answer is recorded: it computes
nothing, counts each record's accounting once (a sample recorded by two shards, or by none,
stops it with one line) and writes each setting's folder as a single run does. What the records
cannot carry is each process's own: the memory peak (and the paged pools' peaks) in a merged
`metrics.json` are the merge's, `run.wall_s` its wall time.

Only tasks whose samples are independent prompts through `engine.generate` shard
(`Task.batches`); a setting evaluated by its own task pass (runner.batch_size > 1, a device KV
limit) or with diagnostics (no records) runs unsharded.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Shard:
    """Shard `index` of `count` (0-based)."""

    index: int
    count: int

    def owns(self, prompt: int, prompts: int) -> bool:
        """Whether prompt `prompt` of a call of `prompts` prompts is this shard's."""
        return owner(prompt, prompts, self.count) == self.index

    @property
    def label(self) -> str:
        return f"{self.index + 1}/{self.count}"


def owner(prompt: int, prompts: int, count: int) -> int:
    """The shard of prompt `prompt` of a call of `prompts` prompts: contiguous blocks."""
    return prompt * count // prompts


def shard_reasons(setting, count: int) -> list[str]:
    """Why this setting cannot be split into `count` shards (each reason names its key)."""
    from harness.sweep.plan import needs_own_pass

    if count == 1:
        return []
    runner, why = setting.runner, []
    if not type(setting.task).batches:
        why.append(f"runner.shards={count}: task={setting.task_name} feeds its samples through "
                   "one stream or a rewound context, not as independent prompts; run it with "
                   "runner.shards=1")
    if needs_own_pass(setting):
        why.append(f"runner.shards={count} with runner.batch_size={runner.batch_size}, "
                   f"runner.kv_device_limit_mib={runner.kv_device_limit_mib} or a method "
                   "with model hooks: such a setting runs its own task pass, not sample by "
                   "sample; use runner.shards=1")
    if runner.diagnostics:
        why.append(f"runner.shards={count} with runner.diagnostics=true: the fidelity shadow "
                   "keeps no per-sample records; use runner.shards=1")
    return why


# A shard process dies with the sweep that started it, even one killed by SIGKILL (which runs no
# handler of the sweep's): the kernel signals it (Linux's parent-death signal, set between fork
# and exec), and the shard also checks its parent itself (other systems, or a sweep that died
# before the signal was armed).
PARENT_ENV = "KVH_SHARD_PARENT"
_PR_SET_PDEATHSIG = 1


def arm_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """preexec_fn of a child process (a shard; the vLLM worker): `sig` when its parent dies
    (Linux; a no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def watch_parent(parent: int, every_s: float = 1.0) -> None:
    """Exit (143, as a terminated process) once the process `parent` is no longer this one's
    parent; 0: no parent to watch (a shard run by hand, or a SLURM array task)."""
    if parent <= 0:
        return

    def check() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(143)

    threading.Thread(target=check, name="shard-parent-watch", daemon=True).start()


def start_local(cfgs, choices, count: int, folder: Path) -> list[tuple[subprocess.Popen, Path]]:
    """`count` shard processes on this machine, each logging to `folder/shard-<i>.log`."""
    folder.mkdir(parents=True, exist_ok=True)
    # runner.threads=null means all cores: shared out between the shards (unless set outside)
    env = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // count)), **os.environ,
           PARENT_ENV: str(os.getpid())}
    procs = []
    for i in range(count):
        job = folder / f"shard-{i}.pkl"
        job.write_bytes(pickle.dumps((cfgs, choices, Shard(i, count))))
        log = folder / f"shard-{i}.log"
        with log.open("w") as out:
            procs.append((subprocess.Popen([sys.executable, "-m", "harness.sweep.run",
                                            str(job)], stdout=out, stderr=subprocess.STDOUT,
                                           env=env, preexec_fn=arm_parent_death_signal),
                          log))
    return procs


def wait_local(procs: list[tuple[subprocess.Popen, Path]]) -> list[str]:
    """Wait for every shard process; one line per shard that failed (with its log's last line)."""
    failed = []
    try:
        for i, (proc, log) in enumerate(procs):
            if proc.wait() != 0:
                tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
                failed.append(f"shard {i + 1}/{len(procs)} exited {proc.returncode}: "
                              f"{tail[-1] if tail else '(no output)'} (log: {log})")
    finally:
        for proc, _ in procs:  # Ctrl-C: our shard processes stop with us
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
    return failed
