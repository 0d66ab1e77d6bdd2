"""Sequential rounds: a sweep run block by block of samples, each round only for the settings
whose question is still open, until every question is answered or the sample budget is spent.

    python -m harness.sweep.rounds task=ruler 'task.lengths=[4096]' method=snapkv,h2o \\
        method.budget_ratio=0.2,0.5 rounds.block=20 rounds.max_n=200 rounds.margin_points=2

Every round is an ordinary multirun of the harness (the same launchers: the sweep engine on this
machine, `runner.shards`, `hydra/launcher=slurm` arrays), driven by a Hydra sweeper
(hydra_plugins/kvh_rounds) instead of the basic one: round r runs the full cache (the reference)
and the still-undecided settings on the task's samples [(r-1) * block, r * block) through
`task.limit` and `task.skip_samples` (RULER), each into its own run folder under
`<ledger dir>/round-<r>/`. After each round the paired per-sample differences with the reference
(paired by sample content id) feed harness.stats.sequential: an anytime-valid confidence sequence per
question, the decisions, and who is sampled next.

Resume: the ledger `<ledger dir>/rounds.json` (written atomically after every round) records each
finished round's folders; the same command again replays those rounds from their folders
(nothing is run again) and continues. A round cut half-way runs again with
`runner.skip_existing=true`, so its finished members are reused and its unfinished ones resume
from their sweep records (harness.sweep.records): no (setting, sample) is answered twice.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable

from harness.report.ledgers import LEDGER, TABLE, summary, table
from harness.stats import sequential as sq
from kvcore.errors import ConfigError
from kvcore.typecheck import check_types

LEDGER_VERSION = 1
# The keys a round sets on every job: a user's value would be silently replaced, so refused.
OWNED = ("task.limit", "task.skip_samples", "runner.skip_existing", "runner.output_dir")
REFERENCE = "full"


@dataclass(frozen=True)
class Knobs:
    """The rounds' knobs (`python -m harness.sweep.rounds`: rounds.<key>; the sweeper's:
    hydra.sweeper.<key>): samples per round (`block`), the sample budget per setting (`max_n`),
    the error over every question (`alpha`), the equivalence margin in the metric's points
    (`margin_points`, 0: never "indistinguishable"), the top k per budget level (`top_k`, None:
    not asked) and where the ledger and the rounds' runs go (`ledger_dir`)."""

    block: int = 20
    max_n: int = 100
    alpha: float = 0.05
    margin_points: float = 0.0
    top_k: int | None = None
    ledger_dir: str | None = None


def check_knobs(raw: dict[str, Any], prefix: str = "rounds.") -> Knobs:
    """The knobs checked (ConfigError naming `<prefix><key>` and what is allowed)."""
    names = [f.name for f in fields(Knobs)]
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]} is not a rounds knob; allowed: "
                          f"{', '.join(prefix + k for k in names)}")
    check_types(Knobs, raw, prefix.rstrip("."))  # types, as for method and task knobs
    k = {**asdict(Knobs()), **raw}
    if k["block"] < 1:
        raise ConfigError(f"{prefix}block={k['block']!r} must be an integer >= 1 (samples a round "
                          "adds per setting)")
    if k["max_n"] < k["block"] or k["max_n"] % k["block"]:
        raise ConfigError(f"{prefix}max_n={k['max_n']!r} must be a multiple of {prefix}block="
                          f"{k['block']} (the sample budget per setting, in whole rounds)")
    if not 0 < k["alpha"] < 1:
        raise ConfigError(f"{prefix}alpha={k['alpha']!r} must be a number in (0, 1) (the error "
                          "over every question, at every round)")
    if not 0 <= k["margin_points"] < 100:
        raise ConfigError(f"{prefix}margin_points={k['margin_points']!r} must be a number in "
                          "[0, 100) (the metric's points; 0: never 'indistinguishable')")
    if k["top_k"] is not None and k["top_k"] < 1:
        raise ConfigError(f"{prefix}top_k={k['top_k']!r} must be an integer >= 1 or null")
    if k["ledger_dir"] is not None and not k["ledger_dir"]:
        raise ConfigError(f"{prefix}ledger_dir={k['ledger_dir']!r} must be a folder path or null")
    if k["ledger_dir"] and "\\" in k["ledger_dir"]:
        raise ConfigError(f"{prefix}ledger_dir={k['ledger_dir']!r}: a backslash cannot pass "
                          "through Hydra's override grammar; use / in paths")
    return Knobs(k["block"], k["max_n"], float(k["alpha"]), float(k["margin_points"]),
                 k["top_k"], k["ledger_dir"])


def unbalanced(block: int, cells: int) -> str | None:
    """Why a round of `block` samples is not balanced over the task's `cells` (None: it is)."""
    if block % cells == 0:
        return None
    return (f"rounds.block={block} is not a multiple of the task's {cells} cells: a round "
            "does not hold every cell equally often, so the intervals' coverage of the cells' "
            f"mean is approximate; e.g. rounds.block={cells * max(1, round(block / cells))}")


def too_few_samples(max_n: int, cells: int, per_cell: int) -> str | None:
    """Why the task cannot give max_n samples (None: it can)."""
    if cells * per_cell >= max_n:
        return None
    return (f"rounds.max_n={max_n} is more than the task's {cells * per_cell} samples "
            f"(task.samples_per_cell={per_cell} x {cells} cells); allowed: "
            f"task.samples_per_cell >= {math.ceil(max_n / cells)}, or a smaller rounds.max_n")


# --- the sweep's settings ------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """The sweep as rounds see it: overrides common to every job, each setting's own (label ->
    overrides, its budget level), and the reference's."""

    common: list[str]
    settings: dict[str, list[str]]
    levels: dict[str, str]
    reference: list[str]


def _level(parts: list[str]) -> str:
    """A setting's budget level: its budget knob's value (settings at a method's defaults: one
    level, "default")."""
    for part in parts:
        key, _, value = part.partition("=")
        if key.lstrip("+").endswith(("budget_ratio", "budget_tokens")):
            return f"{key.rsplit('.', 1)[-1]}={value}"
    return "default"


def plan(arguments: list[str]) -> Plan:
    """The settings of a sweep's overrides (Hydra's grammar; only `method` and `method.*` may be
    swept: rounds compare settings of one model and task with one reference)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(arguments))
    common, swept = [], []
    for o in parsed:
        key = o.get_key_element()
        if o.key_or_group in OWNED:
            raise ConfigError(f"{o.key_or_group} is set by the rounds on every job (from "
                              "rounds.block and rounds.max_n); drop it")
        if not o.is_sweep_override():
            common.append(f"{key}={o.get_value_element_as_str()}")
            continue
        if not o.is_discrete_sweep():
            raise ConfigError(f"{key}: rounds sweep lists of values only (a,b,c)")
        if o.key_or_group != "method" and not o.key_or_group.startswith("method."):
            raise ConfigError(f"{key} has several values: rounds compare settings of one model "
                              "and task against one full cache; sweep method and method.* only")
        swept.append([f"{key}={v}" for v in o.sweep_string_iterator()])
    settings, levels = {}, {}
    for parts in itertools.product(*swept):
        parts = list(parts)
        method = next((p.partition("=")[2] for p in [*parts, *common]
                       if p.partition("=")[0] == "method"), None)
        if method == REFERENCE:
            continue  # the reference runs every round anyway
        label = " ".join(parts) or "setting"
        settings[label], levels[label] = parts, _level(parts + common)
    if not settings:
        raise ConfigError("no setting to compare with the full cache: sweep method=... (and its "
                          "knobs), e.g. method=snapkv,h2o method.budget_ratio=0.2,0.5")
    reference = [p for p in common if p.partition("=")[0].lstrip("+~").split(".")[0]
                 not in ("method",)] + [f"method={REFERENCE}"]
    return Plan([p for p in common], settings, levels, reference)


# --- the ledger ----------------------------------------------------------------------------------

def ledger_dir(knobs: Knobs, results_root: str, the_plan: Plan) -> Path:
    """Where the ledger and the rounds' runs go: rounds.ledger_dir, else a folder of the results
    root named by the sweep (its overrides and knobs), so the same command finds it again."""
    if knobs.ledger_dir:
        return Path(knobs.ledger_dir)
    return Path(results_root) / "_rounds" / identity(knobs, the_plan)


# Knobs a resumed sweep may change: where it is written, and the budget (raising max_n
# continues an undecided sweep; the recorded rounds' decisions do not depend on it).
_FREE_KNOBS = ("ledger_dir", "max_n")


def _fixed(knobs: Knobs) -> dict:
    return {k: v for k, v in asdict(knobs).items() if k not in _FREE_KNOBS}


def identity(knobs: Knobs, the_plan: Plan) -> str:
    blob = json.dumps([asdict(the_plan), _fixed(knobs)], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def open_ledger(path: Path, knobs: Knobs, the_plan: Plan) -> dict:
    """The ledger at `path` (a new one if absent); one written for another sweep is refused."""
    head = {"version": LEDGER_VERSION, "sweep": identity(knobs, the_plan),
            "knobs": _fixed(knobs),
            "reference": the_plan.reference, "common": the_plan.common,
            "settings": the_plan.settings, "levels": the_plan.levels}
    if not path.exists():
        return {**head, "max_n": knobs.max_n, "skipped": {}, "rounds": [], "reported": {},
                "status": "running"}
    try:
        ledger = json.loads(path.read_text())
        same = all(ledger.get(k) == v for k, v in head.items())
    except (OSError, ValueError, AttributeError):
        raise ConfigError(f"{path}: not a rounds ledger (unreadable JSON); move it away or "
                          "choose another rounds.ledger_dir") from None
    if not same:
        raise ConfigError(f"{path} records another sweep (other settings, overrides or rounds "
                          "knobs); rerun with the same ones to resume (rounds.max_n may grow), "
                          "or choose another rounds.ledger_dir")
    done = knobs.block * len(ledger["rounds"])
    if knobs.max_n < done:
        raise ConfigError(f"rounds.max_n={knobs.max_n}: {path} already holds {done} samples "
                          f"per sampled setting; allowed: rounds.max_n >= {done}")
    ledger["max_n"] = knobs.max_n
    ledger.setdefault("skipped", {})
    return ledger


# --- a round -------------------------------------------------------------------------------------

def round_overrides(folder: Path, offset: int, block: int) -> list[str]:
    return [f"task.skip_samples={offset}", f"task.limit={block}",
            f"runner.results_root={folder}", "runner.skip_existing=true"]


def without_root(parts: list[str]) -> list[str]:
    """A job's overrides without the user's results root (the round's replaces it)."""
    return [p for p in parts if p.partition("=")[0].lstrip("+") != "runner.results_root"]


def scores(folder: Path, task: str) -> tuple[list[str], list[float], float]:
    """A run's per-sample keys, scores (the metric's points) and their bound."""
    from harness.stats.uncertainty import load_samples, units

    u = units(task, load_samples(folder / "samples.jsonl", task))
    if u.full_score is None:
        raise ConfigError(f"task={task}: its per-sample scores have no bound; rounds need "
                          "bounded scores (RULER)")
    return [f"{sid}:{i}" for sid, i in u.keys], [float(x) for x in u.values], u.full_score


def paired_block(folders: dict[str, Path], task: str) -> tuple[dict[str, list[float]],
                                                               list[float], float]:
    """Each setting's scores in the reference's sample order (refused when they differ)."""
    keys, ref, bound = scores(folders[REFERENCE], task)
    out = {}
    for label, folder in folders.items():
        if label == REFERENCE:
            continue
        k, v, _ = scores(folder, task)
        if sorted(k) != sorted(keys):
            raise ConfigError(f"{folder}: its samples are not the full cache's of the same round "
                              f"({folders[REFERENCE]}); the round's runs must share samples")
        by_key = dict(zip(k, v))
        out[label] = [by_key[x] for x in keys]
    return out, ref, bound


def read_statuses(sweep_dir: Path, first: int, count: int) -> list[dict]:
    out = []
    for idx in range(first, first + count):
        path = sweep_dir / "status" / f"{idx:04d}.json"
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            out.append({"status": "failed", "detail": f"no status at {path} (the job ended "
                                                      "without one)"})
    return out


class RoundError(ConfigError):
    """A round that could not finish (a member failed or was refused): one line."""


def run_rounds(arguments: list[str], knobs: Knobs, task: str, results_root: str,
               sweep_dir: Path, launch: Callable[[list[list[str]], int], None],
               say: Callable[[str], None] = print) -> dict:
    """Every round until each question is answered or max_n is spent; returns the ledger.

    Args:
        arguments: the sweep's overrides (Hydra's task overrides).
        knobs: checked rounds knobs.
        task: the task's name (its per-sample design, harness.stats.uncertainty).
        results_root: the user's runner.results_root (the ledger's default home).
        sweep_dir: the multirun's folder (where the launcher writes each job's status).
        launch: runs a batch of jobs' overrides with the given first job number.
    """
    the_plan = plan(arguments)
    home = ledger_dir(knobs, results_root, the_plan)
    path = home / LEDGER
    ledger = open_ledger(path, knobs, the_plan)
    design = sq.Design(alpha=knobs.alpha, margin=knobs.margin_points, top_k=knobs.top_k,
                       bound=100.0, block=knobs.block)
    rounds = _replay(ledger, the_plan, design, home, task) if ledger["rounds"] else None
    if rounds is not None:
        say(f"rounds: resuming after round {len(ledger['rounds'])} ({path})")
    job = 0
    while rounds is None or (not rounds.done() and len(rounds.reference) < knobs.max_n):
        number = len(ledger["rounds"]) + 1
        offset, size = len(rounds.reference) if rounds else 0, knobs.block
        labels = [REFERENCE, *sorted(rounds.active if rounds else the_plan.settings)]
        extra = round_overrides(home / f"round-{number:02d}", offset, size)
        say(f"rounds: round {number}: samples [{offset}, {offset + size}) for "
            f"{len(labels) - 1} setting(s) and the full cache")
        launch([without_root(the_plan.reference) + extra] + [
            without_root(the_plan.common + the_plan.settings[x]) + extra for x in labels[1:]],
            job)
        folders = _folders(labels, read_statuses(sweep_dir, job, len(labels)), number, path,
                           ledger if rounds is None else None)
        job += len(labels)
        if rounds is None:  # after round 1: the settings that can run are known
            rounds = sq.Rounds(_levels(ledger, the_plan), design)
        block, ref, bound = paired_block(folders, task)
        if bound != design.bound:
            raise RoundError(f"task={task}: scores bounded by {bound}, not 100 points")
        rounds.add(block, ref)
        ledger["rounds"].append({**rounds.history[-1], "offset": offset, "block": size,
                                 "folders": {k: _relative(v, home) for k, v in folders.items()}})
        _record(path, ledger, rounds, "done" if rounds.done() else "running")
    # every setting's figures as this code computes them (after a replay too)
    _record(path, ledger, rounds, "done" if rounds.done() else "budget spent")
    for line in summary(ledger):
        say(line)
    return ledger


def _levels(ledger: dict, the_plan: Plan) -> dict[str, str]:
    """The settings the rounds decide: the sweep's, but those refused at round 1."""
    kept = {k: v for k, v in the_plan.levels.items() if k not in ledger["skipped"]}
    if not kept:
        raise RoundError("every setting was refused in round 1: "
                         + "; ".join(f"{k}: {v}" for k, v in ledger["skipped"].items()))
    return kept


def _replay(ledger: dict, the_plan: Plan, design: sq.Design, home: Path,
            task: str) -> sq.Rounds:
    """The finished rounds again, from their folders (their recorded decisions checked)."""
    rounds = sq.Rounds(_levels(ledger, the_plan), design)
    for recorded in ledger["rounds"]:
        block, ref, _ = paired_block({k: home / v for k, v in recorded["folders"].items()}, task)
        rounds.add(block, ref)
        if rounds.history[-1]["active_next"] != recorded["active_next"]:
            raise ConfigError(f"{home / LEDGER}: round {recorded['round']}'s folders no longer "
                              "give its recorded decisions (a run folder changed); move the "
                              "ledger folder away to start again")
        recorded.update(rounds.history[-1])  # its figures as this code computes them
    return rounds


def _folders(labels: list[str], statuses: list[dict], number: int, path: Path,
             first: dict | None) -> dict[str, Path]:
    """Each job's run folder from its status. In round 1 (`first`: the ledger) a setting the
    harness refuses (skipped, or inactive: the method never acts at this length) leaves the
    rounds with its reason; any other unfinished job stops them (a rerun resumes)."""
    folders = {}
    for label, status in zip(labels, statuses):
        state, detail = status.get("status"), status.get("detail")
        if state == "ok":
            folders[label] = Path(detail)
        elif first is not None and label != REFERENCE and state in ("skipped", "inactive"):
            first["skipped"][label] = f"{state}: {detail}"
        else:
            raise RoundError(f"round {number}: {label} {state}: {detail}; rerun the same "
                             f"command to resume (ledger: {path})")
    return folders


def _relative(folder: Path, home: Path) -> str:
    return str(folder.relative_to(home)) if folder.is_relative_to(home) else str(folder)


def _record(path: Path, ledger: dict, rounds: sq.Rounds, status: str) -> None:
    ledger["reported"] = _reported(rounds)
    ledger["status"] = status
    _write(path, ledger)


def _reported(rounds: sq.Rounds) -> dict:
    """Stopped settings: their figures at their stopping round; the others: as they stand."""
    out = {}
    for name in rounds.levels:
        if name in rounds.reported:
            out[name] = {**rounds.reported[name], "stopped": True}
        elif rounds.state is not None:
            out[name] = {**rounds.report(name, len(rounds.history)), "stopped": False}
    return out


def _write(path: Path, ledger: dict) -> None:
    """The ledger, and beside it `rounds.md` (the same figures as a table), both atomic."""
    from harness.store.results import write_json_atomic, write_text_atomic

    write_json_atomic(path, ledger)
    write_text_atomic(path.with_name(TABLE), table(ledger))


# --- the command ---------------------------------------------------------------------------------

def split_argv(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """`rounds.<key>=<value>` arguments (YAML values) apart from the sweep's overrides."""
    import yaml

    knobs, rest = {}, []
    for arg in argv:
        if arg.startswith("rounds."):
            key, eq, value = arg[len("rounds."):].partition("=")
            if not eq:
                raise ConfigError(f"{arg}: give rounds.{key}=<value>")
            try:
                knobs[key] = yaml.safe_load(value) if value != "" else None
            except yaml.YAMLError:
                raise ConfigError(f"{arg}: the value cannot be read") from None
        elif arg in ("-m", "--multirun"):
            continue  # a rounds sweep is a multirun anyway
        else:
            rest.append(arg)
    return knobs, rest


def _hydra_value(value: Any) -> str:
    """A knob as Hydra's override grammar reads it back (a path quoted: commas, spaces)."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return "'" + value.replace("'", "\\'") + "'"  # check_knobs refused backslashes
    return str(value)


def main(argv: list[str] | None = None) -> None:
    """Check the rounds knobs (one line, exit 2), then run the harness's multirun with the
    rounds sweeper (hydra_plugins/kvh_rounds)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        raw, rest = split_argv(argv)
        knobs = check_knobs(raw)
        plan(rest)  # the sweep's shape, before anything loads
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    from harness import __main__ as entry

    sweeper = [f"hydra.sweeper.{k}={_hydra_value(v)}" for k, v in asdict(knobs).items()]
    sys.argv = [sys.argv[0], "-m", "hydra/sweeper=kvh_rounds", *sweeper, *rest]
    entry.cli()


if __name__ == "__main__":
    main()
