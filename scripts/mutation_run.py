"""Mutation run of the shared method net: plant plausible bugs, run only the shared tests.

Each mutant is one text substitution in one method file, as a newcomer (or a refactor) would
write it. The script copies the tracked tree to a temporary folder, plants one mutant at a time
there (the working tree is never touched), and runs in a subprocess only the shared tests of the
mutated method (the contract, the knob check and the score direction in tests/methods/contract/:
test_contract.py, test_every_knob_acts.py, test_score_direction.py: the cases whose parameters
start with the method's name).
A mutant is killed when a test fails. `--with-hand` also runs the method's required hand-computed
kept-set test (`@pytest.mark.kept_set` in tests/methods/test_<method>.py).

    python scripts/mutation_run.py [--with-hand] [--only NAME ...]

Prints one line per mutant and the totals; exits 1 when a planted mutant does not apply.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = [f"tests/methods/contract/{name}.py"
          for name in ("test_contract", "test_every_knob_acts", "test_score_direction")]


@dataclass(frozen=True)
class Mutant:
    name: str
    method: str  # whose shared tests run
    path: str
    old: str
    new: str


MUTANTS = [
    Mutant("sinks unprotected", "streaming_llm", "methods/streaming_llm.py",
           "        return min(self.method.sink_tokens, budget), 0",
           "        return 0, 0"),
    Mutant("sinks evicted at decode", "streaming_llm", "methods/streaming_llm.py",
           "        sinks = min(self.method.sink_tokens, budget)  # the sinks",
           "        sinks = 0  # the sinks"),
    Mutant("newest window token evicted", "streaming_llm", "methods/streaming_llm.py",
           "return self.positions[:, :, sinks:].argmin(dim=-1) + sinks",
           "return self.positions[:, :, sinks:].argmax(dim=-1) + sinks"),
    Mutant("observation window unprotected", "snapkv", "methods/snapkv.py",
           "        return 0, min(self.method.window_tokens, budget)",
           "        return 0, 0"),
    Mutant("recent window unprotected", "scissorhands", "methods/scissorhands.py",
           "        return 0, min(self.method.recent_tokens, budget)",
           "        return 0, 0"),
    Mutant("recent share unprotected", "h2o", "methods/h2o.py",
           "        return 0, min(budget, int(round(self.method.recent_ratio * budget)))",
           "        return 0, 0"),
    Mutant("layer budget doubled (layer override)", "h2o", "methods/h2o.py",
           "    def protected(self, budget: int) -> tuple[int, int]:",
           "    def budget(self) -> int:\n        return 2 * super().budget()\n\n"
           "    def protected(self, budget: int) -> tuple[int, int]:"),
    Mutant("bottom layer budget doubled (schedule)", "pyramidkv", "methods/pyramidkv.py",
           "    return window + max_num - layer * steps",
           "    return (2 if layer == 0 else 1) * (window + max_num - layer * steps)"),
    Mutant("layer factors not normalised", "squeezeattention", "methods/squeezeattention.py",
           "            x.budget_factor = factor",
           "            x.budget_factor = max(factor, 1.0)"),
    Mutant("scores reset every step", "h2o", "methods/h2o.py",
           "        scores.add_(group_column_sums(probs, keys.shape[1]))",
           "        scores.zero_().add_(group_column_sums(probs, keys.shape[1]))"),
    Mutant("per-head budgets made uniform", "adakv", "methods/adakv.py",
           "    return counts + (rank < short).to(torch.int64)",
           "    return torch.full_like(counts, budget)"),
    Mutant("per-head budgets made uniform", "headkv", "methods/headkv.py",
           "        return protected + split_tokens(caps.expand(room.shape).to(scores.device), "
           "total, room)",
           "        return torch.full_like(protected, budget)"),
    Mutant("highest norms kept", "knorm", "methods/knorm.py",
           "        return -key_norms(self.keys)",
           "        return key_norms(self.keys)"),
    Mutant("streaming heads drop their sinks", "duo_attention", "methods/_headwise.py",
           "        self.sinks = min(self.method.sink_tokens, max(1, (allowed - comp) // 2), "
           "real_sinks)",
           "        self.sinks = 0"),
    Mutant("compensation slot attended without its +log|D|", "razor_attention",
           "methods/_headwise.py",
           "        return (self.positions == COMP_POSITION).float() * math.log(self.comp_count)",
           "        return (self.positions == COMP_POSITION).float() * 0.0"),
    Mutant("lowest scores picked (selection template)", "oracle_topk", "methods/selection.py",
           "        top = scores.topk(size, dim=-1).indices",
           "        top = scores.topk(size, dim=-1, largest=False).indices"),
    Mutant("lowest pages picked (selection template)", "quest", "methods/selection.py",
           "        top = scores.topk(size, dim=-1).indices",
           "        top = scores.topk(size, dim=-1, largest=False).indices"),
    Mutant("KV head serves one query head's set, not the union", "quest", "methods/selection.py",
           "    return keep.view(b, num_kv_heads, h_sel // num_kv_heads, t).any(2)",
           "    return keep.view(b, num_kv_heads, h_sel // num_kv_heads, t)[:, :, 0]"),
    Mutant("lowest scores picked (torch path)", "infinigen", "methods/_infinigen_speculation.py",
           "    return scores.topk(cap, dim=-1).indices, count",
           "    return scores.topk(cap, dim=-1, largest=False).indices, count"),
    Mutant("lowest scores picked (CPU kernel path)", "infinigen",
           "methods/kernels/speculation_cpu.py",
           "    q, pk = kernel_rows(q_partial), kernel_rows(partial_keys)",
           "    q, pk = kernel_rows(-q_partial), kernel_rows(partial_keys)"),
    Mutant("recent prompt tokens not attended", "tailorkv", "methods/tailorkv.py",
           "        r = min(self.method.recent_tokens, budget - s)",
           "        r = 0"),
    Mutant("scores reset every step (C decode kernel)", "h2o",
           "methods/kernels/colsum_attention_cpu.c",
           "for (long t = s * SPAN_TOKENS; t < t1; t++) acc[t] += e[t] * cf;",
           "for (long t = s * SPAN_TOKENS; t < t1; t++) acc[t] = e[t] * cf;"),
    Mutant("GQA: one query head's attention per group", "h2o", "methods/h2o.py",
           "        scores.add_(group_column_sums(probs, keys.shape[1]))",
           "        scores.add_(group_column_sums(probs[:, :: probs.shape[1] // keys.shape[1]], "
           "keys.shape[1]))"),
    Mutant("recent window one token short", "scissorhands", "methods/scissorhands.py",
           "        return 0, min(self.method.recent_tokens, budget)",
           "        return 0, min(self.method.recent_tokens - 1, budget)"),
    Mutant("pooling kernel ignored", "snapkv", "methods/snapkv.py",
           "prefix, self.method.kernel_tokens,", "prefix, 1,"),
    Mutant("pages ranked by their lower bound", "quest", "methods/kernels/quest_pages.py",
           "    bound = torch.maximum(q * mn, q * mx).sum(-1)  # (B, H_kv, g, P)",
           "    bound = torch.minimum(q * mn, q * mx).sum(-1)  # (B, H_kv, g, P)"),
]


def copy_tree(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True, text=True).stdout.split()
    for rel in files:
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]


def test_env(tree: Path) -> dict:
    # the shared models and data stay where the project finds them (they sit beside it)
    shared = os.environ.get("KVH_SHARED_DIR", str(ROOT.parent / "shared"))
    return {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1",
            "KVH_SHARED_DIR": shared}


def shared_cases(tree: Path) -> list[str]:
    """The shared tests' parametrized case ids (collected once, before any mutant)."""
    proc = subprocess.run([*PYTEST, "--collect-only", *SHARED], cwd=tree, env=test_env(tree),
                          capture_output=True, text=True, check=True)
    return [line for line in proc.stdout.splitlines() if "[" in line and "::" in line]


def cases_of(method: str, cases: list[str]) -> list[str]:
    """The cases of `method`: those whose parameters start with its name (`-k` would match
    substrings too: `quest` in `test_batch_of_ragged_requests...`)."""
    return [c for c in cases if re.split(r"[-.\]]", c.split("[", 1)[1])[0] == method]


def run_tests(tree: Path, mutant: Mutant, with_hand: bool, cases: list[str]) -> tuple[int, str]:
    runs = [["-x", *cases_of(mutant.method, cases)]]
    if with_hand:  # only the marked hand test of the method's own file
        runs.append([f"tests/methods/test_{mutant.method}.py", "-m", "kept_set"])
    env = test_env(tree)
    for args in runs:
        proc = subprocess.run(PYTEST + args, cwd=tree, env=env, capture_output=True, text=True)
        lines = proc.stdout.splitlines()
        failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
        if proc.returncode != 0:
            return proc.returncode, (failed[0] if failed else lines[-1])
    return 0, proc.stdout.strip().splitlines()[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--with-hand", action="store_true",
                        help="also run the method's hand-computed kept-set test")
    parser.add_argument("--only", nargs="*", help="mutated methods to run (default: all)")
    opts = parser.parse_args()
    chosen = [m for m in MUTANTS if not opts.only or m.method in opts.only]
    killed = survived = 0
    with tempfile.TemporaryDirectory(prefix="kvh-mutants-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        cases = shared_cases(tree)
        for mutant in chosen:
            target = tree / mutant.path
            original = target.read_text()
            if original.count(mutant.old) != 1:
                print(f"NOT APPLIED  {mutant.method}: {mutant.name} ({mutant.path} changed)")
                return 1
            target.write_text(original.replace(mutant.old, mutant.new))
            start = time.monotonic()
            try:
                rc, detail = run_tests(tree, mutant, opts.with_hand, cases)
            finally:
                target.write_text(original)
            verdict = "killed" if rc == 1 else "SURVIVED" if rc == 0 else f"error rc={rc}"
            killed += rc == 1
            survived += rc == 0
            seconds = time.monotonic() - start
            print(f"{verdict:9} {mutant.method:17} {mutant.name:40} {seconds:5.0f}s"
                  f"  {detail[:110]}", flush=True)
    print(f"\n{killed} of {len(chosen)} mutants killed, {survived} survived "
          f"({'shared tests + hand kept-set tests' if opts.with_hand else 'shared tests only'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
