"""Mutation run of the shared method net: plant plausible bugs, run only the shared tests.

Each mutant is one text substitution in one method file, as a newcomer (or a refactor) would
write it. The script copies the tracked tree to a temporary folder, plants one mutant at a time
there (the working tree is never touched), and runs in a subprocess only the shared tests of the
mutated method (every test file in tests/methods/contract/ but the mutants' own: the cases whose
parameters start with the method's name).
A mutant is killed when a test fails. `--with-hand` also runs the method's required hand-computed
kept-set test (`@pytest.mark.kept_set` in tests/methods/test_<method>.py). `--by-check` runs
every case (no stop at the first failure) and names every check that failed, with a table of
kills by check at the end. `--newcomer` runs only the issue-51 protocol's mutants: bugs planted
in two methods written from the README (TidalDecode, LagKV) and three in existing methods.

    python scripts/mutation_run.py [--with-hand] [--by-check] [--newcomer] [--only NAME ...]

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
CONTRACT = "tests/methods/contract"
OWN_MUTANTS = "test_contract_mutants.py"  # plants mutants of its own: not a check of a method


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


# The issue-51 protocol: plausible bugs in two methods added from the README alone (a
# cross-layer selector and a kvpress-style scorer) and in three existing methods.
NEWCOMER_MUTANTS = [
    Mutant("re-selection layer never re-selects", "tidaldecode", "methods/tidaldecode.py",
           "        if layer_idx in self.selection_layers:",
           "        if layer_idx == self.selection_layers[0]:"),
    Mutant("group mean over interleaved query heads", "tidaldecode", "methods/tidaldecode.py",
           "        scores = group_mean(probs, keys.shape[1])",
           "        scores = probs.unflatten(1, (-1, keys.shape[1])).mean(1)"),
    Mutant("one query head per group selects", "tidaldecode", "methods/tidaldecode.py",
           "        scores = group_mean(probs, keys.shape[1])",
           "        scores = probs[:, :: probs.shape[1] // keys.shape[1]]"),
    Mutant("group mean of log-probabilities", "tidaldecode", "methods/tidaldecode.py",
           "        scores = group_mean(probs, keys.shape[1])",
           "        scores = group_mean(probs.clamp_min(1e-30).log(), keys.shape[1])"),
    Mutant("scaling forgotten in the selection layer", "tidaldecode", "methods/tidaldecode.py",
           "attention_with_probs(query, keys, values, attention_mask, scaling)",
           "attention_with_probs(query, keys, values, attention_mask, 1.0)"),
    Mutant("selection handed once, then stale", "tidaldecode", "methods/tidaldecode.py",
           "                layer.handed = scores",
           "                layer.handed = scores if layer.handed is None else layer.handed"),
    Mutant("reuse layer declares no source", "tidaldecode", "methods/tidaldecode.py",
           "        self.source_layer = source",
           "        self.source_layer = None"),
    Mutant("selection handed to the next layer only", "tidaldecode", "methods/tidaldecode.py",
           "            layer = layer.next_layer",
           "            layer = None"),
    Mutant("reuse layer scores its own query", "tidaldecode", "methods/tidaldecode.py",
           "        return handed",
           "        return group_mean(attention_with_probs(query, keys, keys, attention_mask, "
           "scaling)[1], keys.shape[1])"),
    Mutant("reference is the partition itself", "lagkv", "methods/lagkv.py",
           "    ref = parts[:, :, 1:]", "    ref = parts[:, :, :-1]"),
    Mutant("softmax across partitions", "lagkv", "methods/lagkv.py",
           "    spread = normed.std(dim=-1).softmax(dim=-1)",
           "    spread = normed.std(dim=-1).softmax(dim=-2)"),
    Mutant("values not scored", "lagkv", "methods/lagkv.py",
           "            lag_scores(values, self.method.sink_tokens, self.method.lag_size)",
           "            0 * lag_scores(values, self.method.sink_tokens, self.method.lag_size)"),
    Mutant("keys scored twice", "lagkv", "methods/lagkv.py",
           "            lag_scores(values, self.method.sink_tokens, self.method.lag_size)",
           "            lag_scores(keys, self.method.sink_tokens, self.method.lag_size)"),
    Mutant("sinks unprotected", "lagkv", "methods/lagkv.py",
           "        return sinks, min(self.tail_tokens(), budget - sinks)",
           "        return 0, min(self.tail_tokens(), budget)"),
    Mutant("tail unprotected", "lagkv", "methods/lagkv.py",
           "        return sinks, min(self.tail_tokens(), budget - sinks)",
           "        return sinks, 0"),
    Mutant("tail one partition short", "lagkv", "methods/lagkv.py",
           "rest - (full - 1) * self.method.lag_size", "rest - full * self.method.lag_size"),
    Mutant("range not divided out", "lagkv", "methods/lagkv.py",
           "    normed = (parts[:, :, :-1] - low) / (high - low).clamp_min(1e-6)",
           "    normed = parts[:, :, :-1] - low"),
    Mutant("reference range over every head", "lagkv", "methods/lagkv.py",
           "    low, high = ref.amin(3, keepdim=True), ref.amax(3, keepdim=True)",
           "    low, high = ref.amin((1, 3), keepdim=True), ref.amax((1, 3), keepdim=True)"),
    Mutant("GQA: query head h voting for KV head h % H_kv", "snapkv", "methods/snapkv.py",
           "    rows = queries.float().reshape(b, h_kv, (h_q // h_kv) * w, d)",
           "    rows = queries.float().view(b, h_q // h_kv, h_kv, w, d).transpose(1, 2)"
           ".reshape(b, h_kv, (h_q // h_kv) * w, d)"),
    Mutant("one query head's attention for the layer", "tova", "methods/tova.py",
           "kwargs[\"scaling\"]).mean(dim=1, keepdim=True)", "kwargs[\"scaling\"])[:, :1]"),
    Mutant("anchor averaged over every head", "keydiff", "methods/keydiff.py",
           "    anchor = unit.mean(dim=2, keepdim=True)",
           "    anchor = unit.mean(dim=(1, 2), keepdim=True)"),
]
MUTANTS += NEWCOMER_MUTANTS


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


def shared_files(tree: Path) -> list[str]:
    """Every test file of the shared contract (tests/methods/contract) but the mutants' own."""
    return sorted(str(p.relative_to(tree)) for p in (tree / CONTRACT).glob("test_*.py")
                  if p.name != OWN_MUTANTS)


def shared_cases(tree: Path) -> list[str]:
    """The shared tests' parametrized case ids (collected once, before any mutant)."""
    proc = subprocess.run([*PYTEST, "--collect-only", *shared_files(tree)], cwd=tree,
                          env=test_env(tree), capture_output=True, text=True, check=True)
    return [line for line in proc.stdout.splitlines() if "[" in line and "::" in line]


def cases_of(method: str, cases: list[str]) -> list[str]:
    """The cases of `method`: those whose parameters start with its name (`-k` would match
    substrings too: `quest` in `test_batch_of_ragged_requests...`)."""
    return [c for c in cases if re.split(r"[-.\]]", c.split("[", 1)[1])[0] == method]


def check_of(line: str) -> str:
    """`FAILED tests/.../test_x.py::test_name[params] - ...` -> `test_x.py::test_name`."""
    case = line.split()[1]
    return case.split("/")[-1].split("[")[0]


def run_tests(tree: Path, mutant: Mutant, with_hand: bool, cases: list[str],
              by_check: bool = False) -> tuple[int, str]:
    """(pytest's exit code, the first failure, or with `by_check` every failed check)."""
    runs = [[*([] if by_check else ["-x"]), *cases_of(mutant.method, cases)]]
    if with_hand:  # only the marked hand test of the method's own file
        runs.append([f"tests/methods/test_{mutant.method}.py", "-m", "kept_set"])
    env = test_env(tree)
    for args in runs:
        proc = subprocess.run(PYTEST + args, cwd=tree, env=env, capture_output=True, text=True)
        lines = proc.stdout.splitlines()
        failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
        if proc.returncode != 0 and by_check and failed:
            return proc.returncode, "; ".join(sorted({check_of(line) for line in failed}))
        if proc.returncode != 0:
            return proc.returncode, (failed[0] if failed else lines[-1])
    return 0, proc.stdout.strip().splitlines()[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--with-hand", action="store_true",
                        help="also run the method's hand-computed kept-set test")
    parser.add_argument("--only", nargs="*", help="mutated methods to run (default: all)")
    parser.add_argument("--by-check", action="store_true",
                        help="run every case and name every check that failed")
    parser.add_argument("--newcomer", action="store_true",
                        help="only the issue-51 protocol's mutants (NEWCOMER_MUTANTS)")
    opts = parser.parse_args()
    pool = NEWCOMER_MUTANTS if opts.newcomer else MUTANTS
    chosen = [m for m in pool if not opts.only or m.method in opts.only]
    killed = survived = 0
    kills_by_check: dict[str, int] = {}
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
                rc, detail = run_tests(tree, mutant, opts.with_hand, cases, opts.by_check)
            finally:
                target.write_text(original)
            verdict = "killed" if rc == 1 else "SURVIVED" if rc == 0 else f"error rc={rc}"
            killed += rc == 1
            survived += rc == 0
            if rc == 1 and opts.by_check:
                for check in detail.split("; "):
                    kills_by_check[check] = kills_by_check.get(check, 0) + 1
            seconds = time.monotonic() - start
            width = 400 if opts.by_check else 110
            print(f"{verdict:9} {mutant.method:17} {mutant.name:40} {seconds:5.0f}s"
                  f"  {detail[:width]}", flush=True)
    print(f"\n{killed} of {len(chosen)} mutants killed, {survived} survived "
          f"({'shared tests + hand kept-set tests' if opts.with_hand else 'shared tests only'})")
    if kills_by_check:
        print("\n| check | mutants it kills |\n|---|---|")
        for check, count in sorted(kills_by_check.items(), key=lambda kv: -kv[1]):
            print(f"| {check} | {count} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
