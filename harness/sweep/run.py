"""A sweep in one process: the settings of one model and one task, each written to its own
result folder exactly as `harness.run.run` writes a single run (the same metrics.json, built
by `harness.run.build_metrics`), evaluated together by harness.sweep.execute (model, tokenizer
and task loaded once, each prompt prefilled once per prefill group).
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from harness.sweep.shards import PARENT_ENV, Shard, shard_reasons, watch_parent
from kvcore.errors import ConfigError, UnsupportedCombination


@dataclass
class Outcome:
    """What became of one setting: ok (its folder), skipped (a complete result existed, or the
    combination is refused before weights) or failed (one line)."""

    status: str  # ok | skipped | failed
    detail: str
    folder: Path | None = None


def run_sweep(cfgs: list[DictConfig], copy_on_use: bool = True,
              choices: list[dict[str, str]] | None = None, shard=None,
              merge: int = 0) -> list[Outcome]:
    """Run every config (same model and task) through the sweep engine; one Outcome each, in
    order. Refused settings are reported and the others run. `choices`: each member's config
    file per group (Hydra's runtime choices), when the configs come from a multirun.
    `shard` (harness.sweep.shards.Shard): answer and record that shard's samples only, write
    no folder (Outcome "ok", detail: the shard); `merge=n`: write every setting's folder from
    the records of its n shards, computing nothing."""
    from harness.sweep import execute as sweep_engine
    from harness.sweep import plan as sweep_plan
    from harness.core.profiling import reset_peak_memory
    from harness.run import build_metrics, output_dir, seed_everything, write_result
    from harness.session import Session, compose
    from harness.config.multirun import resolve_output

    t_start = time.time()
    outcomes: list[Outcome | None] = [None] * len(cfgs)
    composed = {}
    for i, cfg in enumerate(cfgs):
        try:
            composed[i] = compose(cfg, choices[i] if choices else None)
        except UnsupportedCombination as exc:
            outcomes[i] = Outcome("skipped", str(exc))
        except ConfigError as exc:  # this setting's bad input; the others go on
            outcomes[i] = Outcome("failed", str(exc))
    if not composed:
        return outcomes
    session = Session(list(composed.values()))
    todo, outs, records = [], {}, {}
    count = shard.count if shard is not None else merge or 1
    for i, setting in composed.items():
        try:
            session.validate(setting)
            refused = shard_reasons(setting, count)
            if refused:
                raise ConfigError("; ".join(refused))
        except UnsupportedCombination as exc:
            outcomes[i] = Outcome("skipped", str(exc))
            continue
        except ConfigError as exc:
            outcomes[i] = Outcome("failed", str(exc))
            continue
        out = output_dir(setting.runner, setting.task_name, session.spec.name,
                         setting.method_name)
        done = resolve_output(setting.runner, out, setting.identity)
        if done is not None:
            print(f"skipped: a complete result for this config ({setting.identity}) exists at "
                  f"{done}")
            outcomes[i] = Outcome("ok", str(done), done)  # as a single run returns it
            continue
        try:  # before weights load: a foreign, stale or malformed record file refuses
            records[i] = setting_records(setting, shard, merge, count)
        except ConfigError as exc:
            outcomes[i] = Outcome("failed", str(exc))
            continue
        todo.append(i)
        outs[i] = out
    if not todo:
        return outcomes

    import torch

    first = composed[todo[0]].runner
    if first.threads:
        torch.set_num_threads(first.threads)
    seed_everything(first.seed)
    session.load(first.attn_impl)
    members = []
    for i in todo:
        seed_everything(composed[i].runner.seed)  # as a single run seeds before prepare
        members.append(sweep_plan.Member(composed[i], session.engine(composed[i])))
    records = [records[i] for i in todo]
    resumed = sum(r.resumed for r in records if r)
    if resumed and not merge:
        print(f"sweep engine: resuming, {resumed} (setting, sample) answers recorded before:")
        for m, r in zip(members, records):
            if r and r.resumed:
                print(f"  {m.setting.label}: {r.resumed} from {r.path}")
    if merge:
        print(f"sweep engine: merging the records of {merge} shards ({resumed} (setting, "
              "sample) answers)")
    for m in members:
        if m.own_pass and shard is None:
            print(f"sweep engine: {m.setting.label}: its own task pass ({m.own_pass})")
    reset_peak_memory(members[0].engine.device)
    groups = sweep_plan.plan_groups(members, session.info)
    passes = sweep_engine.evaluate(members, groups, copy_on_use, records, bool(merge), shard)
    if shard is not None:
        list(passes)  # a shard answers and records; it scores nothing
        print(shared_summary(members, groups))
        for i in todo:
            outcomes[i] = Outcome("ok", f"shard {shard.label} recorded")
        return outcomes
    for k, result in passes:
        i, member = todo[k], members[k]
        group = next((g for g in groups if k in g.members), None)
        extra = {"sweep": {"settings": len(todo),
                           "prefill_shared_with": shared_with(group, groups),
                           "prompts_prefilled_once": group.shared_prefills if group else 0,
                           "prefill_replayed": replayed(group),
                           "prefill_replay_refused": group.replay_refused if group else None,
                           # the eager recording (its layers attend with probabilities)
                           "prefill_replayed_eager": bool(replayed(group) and group.eager),
                           "shards": merge or 1,
                           "decode_batch": member.decode_batch,
                           "own_task_pass": member.own_pass,
                           "identical_to_full": member.identical_to_full}}
        metrics = build_metrics(session, member.setting, member.engine, result, t_start, extra)
        folder = write_result(member.setting, outs[i], metrics, result, member.engine)
        if records[k]:
            records[k].remove()
        outcomes[i] = Outcome("ok", str(folder), folder)
    print(shared_summary(members, groups))
    return outcomes


def replayed(group) -> bool:
    """Whether the group's prompt states came from a recorded forward (a task feeding no prompt
    through `generate`, streaming perplexity, records none)."""
    return group is not None and group.forward is not None and group.shared_prefills > 0


def shared_with(group, groups) -> int:
    """How many other settings' prefills shared this group's: its group's, and the groups
    replaying the same recorded forward (harness.sweep.replay) to the end."""
    if group is None:
        return 0
    same = [g for g in groups if replayed(g) and g.forward is group.forward]
    return sum(len(g.members) for g in same or [group]) - 1


def shared_summary(members, groups) -> str:
    """One line per prefill group: who shared each prompt's prefill, and how often it could;
    then one per recorded forward: the groups that replayed it."""
    lines = [f"sweep engine: {len(members)} settings, {len(groups)} prefill group(s)"]
    streamed = [g for g in groups if g.streams]
    if streamed:
        batch = max(m.decode_batch for m in members)
        lines.append(f"  streamed         {sum(len(g.members) for g in streamed)} settings: "
                     f"{streamed[0].streams} token stream(s), each token fed to every "
                     f"setting's own layers, up to {batch} settings a forward")
    for g in groups:
        if g.streams and not g.shared_prefills:
            continue  # a stream's prompt (if any) is each setting's own
        names = ", ".join(members[k].setting.label for k in g.members)
        if len(g.members) == 1:
            lines.append(f"  {'replayed' if replayed(g) else 'own prefill':16} {names}")
        elif g.per_member:
            lines.append(f"  replayed each    {names}: {g.shared_prefills} prompt(s), the "
                         "forward replayed into each setting (its state cannot be copied)")
        else:
            lines.append(f"  shared prefill   {names}: {g.shared_prefills} prompt(s) prefilled "
                         f"once" + (f", {g.own_prefills} per setting (state not copyable)"
                                    if g.own_prefills else ""))
        if g.replay_refused:
            lines.append(f"    not replayed   {g.replay_refused}: its own forward from then on")
    forwards = {id(g.forward): g.forward for g in groups if replayed(g)}
    for forward in forwards.values():
        same = [g for g in groups if g.forward is forward and replayed(g)]
        eager = sum(len(g.members) for g in same if g.eager)
        lines.append(f"  one forward      {forward.recorded[False]} prompt(s) recorded once"
                     + (f" (and {forward.recorded[True]} with eager attention, for {eager} "
                        "setting(s))" if forward.recorded[True] else "")
                     + f", replayed into {len(same)} group(s) "
                       f"({sum(len(g.members) for g in same)} settings)")
    for m in members:
        if m.own_pass:
            lines.append(f"  own task pass    {m.setting.label}: {m.own_pass}")
    return "\n".join(lines)


def setting_records(setting, shard, merge: int, count: int):
    """The setting's records (None under diagnostics: it keeps none): its own file, or, for a
    merge, its shards' files; refused by name when a record file of this setting from a sweep
    split otherwise lies beside them."""
    from harness.sweep.records import Records, owner, record_path, strays

    if setting.runner.diagnostics:
        return None
    stray = strays(setting.runner, setting.identity, count)
    if stray:
        raise ConfigError(f"sweep records of {setting.label} from a sweep split otherwise lie in "
                          f"{stray[0].parent} ({', '.join(p.name for p in stray)}): resume with "
                          "the runner.shards that wrote them, or remove them")
    if not merge:
        return Records(record_path(setting.runner, setting.identity, shard),
                       owner(setting, shard))
    shards = [Shard(j, merge) for j in range(merge)]
    return Records.merged([record_path(setting.runner, setting.identity, s) for s in shards],
                          [owner(setting, s) for s in shards])


def run_shard_file(path: Path) -> None:
    """A shard process (harness.sweep.shards.start_local starts `python -m harness.sweep.run
    <path>`): the pickled (configs, choices, shard) at `path`."""
    watch_parent(int(os.environ.get(PARENT_ENV, "0")))
    cfgs, choices, shard = pickle.loads(path.read_bytes())
    run_sweep(cfgs, choices=choices, shard=shard)


if __name__ == "__main__":
    run_shard_file(Path(sys.argv[1]))
