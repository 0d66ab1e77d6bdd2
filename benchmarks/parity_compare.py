"""The comparer of `make parity` (benchmarks/parity.py): reads prompts.json, ours.json and
peer.json, prints one row per method and `parity: N/N methods within tolerance`.

Per sample and (layer, KV head) it compares the kept text positions (Jaccard |A n B| / |A u B|, or
containment |A n B| / min(|A|, |B|) for a row whose budgets differ by design). Where every layer
and head kept the same set, the two caches hold the same K/V, so the greedy answers must be the
same and the logits of each answer step (while the answers agree, at the ids in both top lists)
within the fp32 tolerance. A row out of tolerance names its first failure: the sample, the
layer, the head and the first differing position (or the first differing answer step).

Ties. A top-k cut at a near-tie flips with fp noise (another CPU, another summation order), so
a position kept on one side only is a tie flip, not a disagreement, when on both sides its score
lies within the stated margin of the score at the cut (prompts.json `tie_margin_rel`, relative to
the head's largest |score|; both sides record those positions as `near_cut`). Sets that differ by
tie flips alone count as the same sets for the kept check (the row reports how many); their
caches differ by near-tied tokens, so their answers and logits are not held to the tolerance.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Row:
    """What one method's comparison found, over its kept ratios and samples."""

    case: object
    overlap_min: float = 1.0
    overlap_sum: float = 0.0
    overlap_n: int = 0
    identical_samples: int = 0
    samples: int = 0
    answers_equal: int = 0
    logit_steps: int = 0
    logit_max: float = 0.0
    failures: list[str] = field(default_factory=list)
    tie_flips: int = 0  # positions kept on one side only, each at a near-tie on both sides
    budget_gap: int = 0  # largest |our kept count - kvpress's| over layers (containment rows)
    schedule: str = ""  # containment rows: kept counts of the first and last layer, first sample

    @property
    def within(self) -> bool:
        return not self.failures


def overlap(a: set, b: set, kind: str) -> float:
    inter = len(a & b)
    if kind == "containment":
        return inter / max(1, min(len(a), len(b)))
    return inter / max(1, len(a | b))


def tie_flips(a: set, b: set, ours_near: list, peer_near: list, layer: int, head: int) -> bool:
    """Whether every position kept on one side only is near the cut on both sides."""
    def near(record: list) -> set:
        return set(record[layer][head]) if layer < len(record) and head < len(record[layer]) \
            else set()
    return bool(a ^ b) and (a ^ b) <= (near(ours_near) & near(peer_near))


def compare_kept(row: Row, name: str, ours: list, peer: list, ours_near: list = (),
                 peer_near: list = ()) -> bool:
    """Kept sets of one sample; True when every layer and head kept the same set (`ours_near`,
    `peer_near`: per layer and head, the positions near each side's cut: see Ties)."""
    kind = row.case.kept
    if len(ours) != len(peer):
        row.failures.append(f"{name}: {len(ours)} layers compressed here, {len(peer)} in kvpress")
        return False
    same = True
    if kind == "containment" and not row.schedule:
        row.schedule = (f"{name}: layer 0 keeps {len(ours[0][0])} here, {len(peer[0][0])} in "
                        f"kvpress; layer {len(ours) - 1}: {len(ours[-1][0])} here, "
                        f"{len(peer[-1][0])} in kvpress")
    for layer, (ol, pl) in enumerate(zip(ours, peer)):
        for head, (o, p) in enumerate(zip(ol, pl)):
            a, b = set(o), set(p)
            if kind == "jaccard" and tie_flips(a, b, ours_near, peer_near, layer, head):
                row.tie_flips += len(a ^ b)
                same = False  # near-tied tokens differ: answers are not compared
                a = b
            value = overlap(a, b, kind)
            row.overlap_min = min(row.overlap_min, value)
            row.overlap_sum += value
            row.overlap_n += 1
            row.budget_gap = max(row.budget_gap, abs(len(a) - len(b)))
            if a != b:
                same = False
            if value < row.case.kept_min and not any(f.startswith(name) for f in row.failures):
                first = min(a ^ b)
                side = "ours only" if first in a else "kvpress only"
                row.failures.append(
                    f"{name}: layer {layer} head {head}: {kind} {value:.3f} < {row.case.kept_min}"
                    f" (kept {len(a)} here, {len(b)} in kvpress; first differing position "
                    f"{first}, {side})")
    return same


def compare_answers(row: Row, name: str, ours: dict, peer: dict, logit_abs: float) -> None:
    """Greedy ids and per-step logits of a sample whose caches hold the same tokens."""
    go, gp = ours["generated"], peer["generated"]
    if go == gp:
        row.answers_equal += 1
    else:
        step = next((i for i, (x, y) in enumerate(zip(go, gp)) if x != y), min(len(go), len(gp)))
        row.failures.append(f"{name}: same kept sets but answers differ at step {step} "
                            f"(ours {go[step:step + 3]}, kvpress {gp[step:step + 3]})")
    for step, (lo, lp) in enumerate(zip(ours["logits"], peer["logits"])):
        if go[:step] != gp[:step]:
            break  # different inputs from here on
        peer_at = dict(zip(lp["ids"], lp["values"]))
        common = [(v, peer_at[i]) for i, v in zip(lo["ids"], lo["values"]) if i in peer_at]
        if not common:
            row.failures.append(f"{name}: step {step}: no common id in the top logits")
            continue
        diff = max(abs(x - y) for x, y in common)
        row.logit_steps += 1
        row.logit_max = max(row.logit_max, diff)
        if diff > logit_abs and not any(f.startswith(f"{name}: step") for f in row.failures):
            row.failures.append(f"{name}: step {step}: max |logit diff| {diff:.2e} > {logit_abs:g}")


def build_rows(prompts: dict, ours: dict, peer: dict, cases: dict, logit_abs: float) -> list[Row]:
    ours_by = {r["case"]: r["samples"] for r in ours["results"]}
    peer_by = {r["case"]: r["samples"] for r in peer["results"]}
    rows: dict[str, Row] = {}
    for spec in prompts["cases"]:
        row = rows.setdefault(spec["row"], Row(cases[spec["row"]]))
        for so, sp in zip(ours_by[spec["name"]], peer_by[spec["name"]]):
            name = f"{spec['name']} {so['id']}"
            row.samples += 1
            # the control compresses nothing: kvpress records no layer then, we record all
            same = spec["peer"]["press"] is None or compare_kept(
                row, name, so["kept"], sp["kept"], so.get("near_cut", []), sp.get("near_cut", []))
            if same:
                row.identical_samples += 1
            if same and row.case.answers:
                compare_answers(row, name, so, sp, logit_abs)
            elif go_equal(so, sp):
                row.answers_equal += 1
    return list(rows.values())


def go_equal(a: dict, b: dict) -> bool:
    return a["generated"] == b["generated"]


def table(rows: list[Row], logit_abs: float) -> list[str]:
    lines = ["| method | kept sets | same sets | answers equal | max abs logit diff (steps) "
             "| tolerance | within | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r.case
        kept = ("-" if r.overlap_n == 0 else
                f"{c.kept} min {r.overlap_min:.3f} mean {r.overlap_sum / r.overlap_n:.4f}")
        if r.tie_flips:
            kept += f"; {r.tie_flips} tie flip(s) at the cut"
        if c.kept == "containment" and r.overlap_n:
            kept += f"; kept counts differ by up to {r.budget_gap} ({r.schedule})"
        logits = f"{r.logit_max:.1e} ({r.logit_steps})" if r.logit_steps else "-"
        answers = f"{r.answers_equal}/{r.samples}" if c.answers else "-"
        then = f"; same sets => same answers, logits <= {logit_abs:g}" if c.answers else ""
        tol = f"{c.kept} >= {c.kept_min:g}{then}" if c.counted else "not counted"
        verdict = ("yes" if r.within else "NO") if c.counted else "-"
        lines.append(f"| {c.name} | {kept} | {r.identical_samples}/{r.samples} | "
                     f"{answers} | {logits} | {tol} | {verdict} | {c.note} |")
    return lines


def compare_folder(folder: Path, cases: dict, logit_abs: float) -> int:
    load = lambda name: json.loads((folder / name).read_text())  # noqa: E731
    prompts, ours, peer = load("prompts.json"), load("ours.json"), load("peer.json")
    rows = build_rows(prompts, ours, peer, cases, logit_abs)
    print(f"peer: kvpress {peer['peer']['kvpress']} (transformers {peer['peer']['transformers']}); "
          f"ours: transformers {ours['ours']['transformers']}; torch {ours['ours']['torch']}")
    print(f"model: {prompts['model']}; {len(prompts['samples'])} RULER samples "
          f"({prompts['ruler']}), kept ratios {prompts['kept_ratios']}")
    print(f"ties: a position kept on one side only counts as a tie flip when, on both sides, "
          f"its score is within {prompts.get('tie_margin_rel', 0):g} x the head's largest "
          "|score| of the score at the cut")
    print("\n".join(table(rows, logit_abs)))
    for r in rows:
        for failure in r.failures[:3] if r.case.counted else []:
            print(f"MISMATCH {r.case.name}: {failure}")
    counted = [r for r in rows if r.case.counted]
    within = sum(r.within for r in counted)
    print(f"parity: {within}/{len(counted)} methods within tolerance")
    return 0 if within == len(counted) else 1
