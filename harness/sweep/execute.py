"""Prefill once, compress many: one pass answers a task's requests for every setting of a sweep.

The settings of a sweep share the model and the task (harness.session). A task hands over its
work as data (`Task.requests`: `GenerationRequest`s, `ScoreStreamRequest`s; tasks.engine_api),
built once from the model's facts, and scores the answers with its own code (`Task.score`,
once per setting, over that setting's own engine and accounting, as in a single run). So the
sweep is one loop, `evaluate`:

    for each request of the task,
      for each prompt,
        for each prefill group (its shared prompt state made as its turn comes),
          for each setting still to answer it: `Decoder.add`

Where one (setting, prompt) runs: `harness.sweep.decode.Decoder.add` opens the setting's request
on its own engine, gives it its prompt state (its copy of the group's shared prefill, the
recorded forward replayed into it, or its own prefill), compresses it at the prompt's end and
feeds the query; it decodes there, alone, or batched with other settings in `Decoder.flush`.
From `python -m harness -m ...` it is four hops: `SweepLauncher.launch`
(hydra_plugins/kvh_sweep) -> `run_group` -> `harness.sweep.run.run_sweep` -> `evaluate` (here)
-> `Decoder.add`. A stream (`ScoreStreamRequest`) is scored for every setting by
`SharedPass.score_stream`. A task that needs a live engine (`Task.needs_live_engine`:
multi-turn's conversations, lm-eval, chunked perplexity) and a setting whose runner decodes its
prompts together (batches, a device KV limit) is evaluated by its own pass over its own engine
instead (`own_pass_reason`: printed, and recorded in metrics.json `run.sweep`).

Prefill groups (which settings share a prompt state) and the settings identical to the full
cache by rule are planned in harness.sweep.plan.

One forward. The groups of settings whose runners feed prompts alike share more: the model's
dense forward of each prompt is run once, recorded, and replayed into each group's layers
(harness.sweep.replay: every call the model makes on a layer, made again on that group's
layers without the model), so a sweep of many methods pays for the linear layers of a prompt
once. Replay is checked at every layer (each layer's attention output must equal the
recording's, bit for bit); a group whose layers attend otherwise moves to the recording made
with eager attention, then to a forward of its own, and the reason is recorded.

A group whose prompt state cannot be copied (a host KV store, an object of the method's own)
replays the forward once to check it, then into each member's own request. A setting gets its
own prefill when its runner feeds prompts otherwise (chunked or sparse prefill, an offloaded
cache, a diagnostics shadow).
What the shared prefill cost (its timed chunks, its tokens, the bytes it moved between tiers;
with a replay, the recorded forward's and the replay's time) is counted in every setting's
figures, as a single run of it would count it. The settings' answers to one prompt are
decoded one at a time, or `runner.sweep_decode_batch` of them together, one batched forward
per step (harness.sweep.decode).

One token stream (streaming perplexity, `score_stream`) is teacher-forced through every
setting: no prompt is shared (each setting's layers act on every token), but the settings step
in lockstep, `runner.sweep_decode_batch` at a time, one batched forward per token.

Paired fidelity (`task.fidelity_tokens`, harness.core.fidelity; a request declares it:
`GenerationRequest.fidelity_tokens`, `golds`) runs in the answers' pass: for each prompt, the
full cache's reference once, then each setting's fidelity request starts from the same prompt
state its answer got from its group (the prompt's forward and each group's replay serve both),
and the settings are teacher-forced in lockstep, `runner.sweep_decode_batch` at a time
(harness.sweep.decode.FidelityBatch), every setting fed the same reference tokens.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from harness.core import batch as batching
from harness.sweep import records as sweep_records
from harness.sweep import replay as sweep_replay
from harness.core.prompting import score_prompt
from harness.core import fidelity
from harness.core.progress import progress
from harness.sweep.decode import (Decoder, FidelityBatch, decodes_alone, give_prompt_state,
                                   stream_fidelity_records)
from harness.sweep.plan import Group, Member, donor_key, rule_budget
from kvcore.errors import ConfigError
from tasks.engine_api import Answer, GenerationRequest, ScoreStreamRequest

@dataclass
class Call:
    """One `GenerationRequest` of the task and every member's answers to it."""

    request: GenerationRequest
    outputs: list[list[list[int]]]  # per member, per prompt
    index: int  # the task's generation requests before it (a record's call index)
    stop_ids: set[int]  # the request's, or the engine's where it names none
    fidelity_keys: list[tuple | None] = field(default_factory=list)  # per prompt (sample_key)


class SharedPass:
    """What the sweep's shared pass holds while it answers a task's requests for every member
    (`evaluate` runs the loop): the prefill groups, the members' records, the answers so far,
    the fidelity records made in the pass."""

    def __init__(self, members: list[Member], groups: list[Group], copy_on_use: bool = True,
                 records: list | None = None, shard=None, merge: bool = False):
        self.members, self.groups = members, groups
        # per member: its harness.sweep.records.Records (answers kept across a kill), or None
        self.records = records or [None] * len(members)
        # shard: a harness.sweep.shards.Shard, answering its prompts only (the others: []);
        # merge: every answer is recorded (by the shards), none is computed
        self.shard, self.merge = shard, merge
        self.calls = 0  # generation requests opened so far (a record's call index)
        self.copy_on_use = copy_on_use  # False only in the test that plants the sharing bug
        self.order = [k for g in groups for k in g.members]
        self.first = self.order[0]
        # per member: its method's rule budget, and the samples that fit it (None: no rule)
        self.budgets = {k: rule_budget(members[k].setting.method) for k in self.order}
        self.identical = {k: None if b is None else 0 for k, b in self.budgets.items()}
        self.gained: dict[int, dict] = {}  # per member: what its last answer added (a tally)
        # settings decoded together (harness.sweep.decode): the smallest any member allows
        self.decode_batch = min(members[k].setting.runner.sweep_decode_batch for k in self.order)
        # fidelity records computed in the answers' pass (`_pass_fidelity`): sample key ->
        # member -> record
        self.fidelity_done: dict[tuple, dict[int, dict]] = {}

    def open_call(self, request: GenerationRequest) -> Call:
        self.calls += 1
        stop_ids = (self.members[self.first].engine.stop_token_ids() if request.stop_ids is None
                    else set(request.stop_ids))
        return Call(request, [[] for _ in self.members], self.calls - 1, stop_ids)

    def owns(self, i: int, request: GenerationRequest) -> bool:
        """Whether this pass answers prompt i (a shard answers its own prompts only)."""
        return self.shard is None or self.shard.owns(i, len(request.prompts))

    def skip(self, call: Call) -> None:
        """Another shard's prompt: no answer here."""
        for outputs in call.outputs:
            outputs.append([])
        call.fidelity_keys.append(None)

    def note_members(self) -> None:
        """What the pass learnt of each member: its samples identical to the full cache by
        rule, and the settings its decode steps ran with."""
        for k, count in self.identical.items():
            self.members[k].identical_to_full = count
            if not decodes_alone(self.members[k].engine, self.decode_batch):
                self.members[k].decode_batch = self.decode_batch

    @contextlib.contextmanager
    def turn(self, call: Call, i: int) -> Iterator["Turn"]:
        """Prompt i of the call, while every member answers it: what its members' requests
        need (`Turn`: the decoder they join, the fidelity batch its groups' states feed); at
        its end the answers decoded, the rule-identical members given theirs, the prompt's
        fidelity records kept and its recorded forward released."""
        request = call.request
        prompt, query, limit = request.prompts[i], request.query(i), request.max_new_tokens[i]
        where = (call.index, i, sweep_records.prompt_key(prompt, query, limit))
        reuse = self._reuse(len(prompt) + len(query or []) + limit)
        key, forcing = self._pass_fidelity(request, i, call.stop_ids, where)
        call.fidelity_keys.append(key)
        with Decoder(self.decode_batch, call.stop_ids, request.min_new_tokens,
                     functools.partial(self._done, call, where), self.copy_on_use) as decoder, \
                forcing or contextlib.nullcontext():
            yield Turn(self, call, where, reuse, decoder, forcing)
        self._take_rule_answers(call, where, reuse)
        if forcing is not None:
            self.fidelity_done[key] = forcing.records
            for k, rec in forcing.records.items():
                if self.records[k] and not self.merge:  # a resumed sweep takes it from there
                    self.records[k].append_fidelity(*where, rec)
        for forward in {id(g.forward): g.forward for g in self.groups if g.forward}.values():
            forward.release()  # one prompt's recording held at a time

    def answers(self, call: Call) -> dict[int, Answer]:
        """Every member's answer to the call's request, its fidelity records included (a shard
        keeps none: its merge computes them)."""
        keyed = call.request.fidelity_tokens and self.shard is None
        return {k: Answer(outputs=call.outputs[k],
                          fidelity=[self.fidelity_done[key][k] for key in call.fidelity_keys]
                          if keyed else None)
                for k in self.order}

    def score_stream(self, request: ScoreStreamRequest) -> dict[int, Answer]:
        """Every member's `Engine.score_stream` of one token stream: the members whose steps
        can share a forward in lockstep, `decode_batch` at a time (harness.core.batch.stream_requests),
        the others alone; with the stream's fidelity where the request declares it
        (harness.sweep.decode.stream_fidelity_records)."""
        final = int(request.ids.numel())
        scores: dict[int, torch.Tensor] = {}
        together = []
        for k in self.order:
            engine = self.members[k].engine
            if decodes_alone(engine, self.decode_batch):
                scores[k] = engine.score_stream(request)
            else:
                together.append(k)
        for start in range(0, len(together), self.decode_batch):
            chunk = together[start:start + self.decode_batch]
            with contextlib.ExitStack() as stack:  # closing it accounts every request
                requests = [stack.enter_context(self.members[k].engine.request(final_tokens=final))
                            for k in chunk]
                rows = batching.stream_requests(requests, request.ids, request.prompt_tokens,
                                                request.score)
            scores.update(zip(chunk, rows))
        for group in self.groups:
            group.streams += 1
        fidelity = dict.fromkeys(self.order)
        if request.fidelity:
            per = stream_fidelity_records([self.members[k].engine for k in self.order],
                                          request.ids, request.prompt_tokens, self.decode_batch)
            fidelity = dict(zip(self.order, per))
        return {k: Answer(scores=scores[k], fidelity=fidelity[k]) for k in self.order}

    def _pass_fidelity(self, request: GenerationRequest, i: int, stop_ids: set[int],
                       where: tuple[int, int, str]) -> tuple[tuple | None, FidelityBatch | None]:
        """Prompt i's fidelity in the answers' pass, when its request asks it (not in a shard:
        its merge does it): its key (harness.core.fidelity.sample_key), and a batch
        (harness.sweep.decode.FidelityBatch) that each member's request joins as its group's
        prompt state is made, from that state (a copy each; None: it prefills the prompt), so
        the prompt's forward and each group's replay of it serve the answers and the fidelity
        alike; the full cache's reference computed now. No batch: none asked, or the same
        sample's records are made already (in this pass, or recorded for every member before a
        restart)."""
        if not request.fidelity_tokens or self.shard is not None:
            return None, None
        item = request.fidelity_item(i)
        lead = self.members[self.first].engine
        key = fidelity.sample_key(lead, item, request.fidelity_tokens, stop_ids,
                                  request.min_new_tokens)
        if key in self.fidelity_done:
            return key, None
        kept = {k: self.records[k].fidelity_of(*where) if self.records[k] else None
                for k in self.order}
        if None not in kept.values():
            self.fidelity_done[key] = kept
            return key, None
        ref = fidelity.reference(lead, item, request.fidelity_tokens, stop_ids,
                                 request.min_new_tokens)
        return key, FidelityBatch(item, ref, self.decode_batch)

    def _reuse(self, seq_tokens: int) -> dict[int, int]:
        """member -> the member whose answer it takes for a sequence of `seq_tokens` tokens:
        every member identical to the full cache by its method's rule (`rule_budget`) takes the
        answer of the first such member (or of a full-cache reference) with the same arithmetic;
        each such sample is counted in `identical_to_full`."""
        donors: dict[str, int] = {}
        reuse: dict[int, int] = {}
        order = sorted((k for g in self.groups for k in g.members),
                       key=lambda k: self.members[k].setting.method.capabilities.compresses)
        for k in order:
            setting = self.members[k].setting
            rule = self.budgets[k] is not None and seq_tokens <= self.budgets[k]
            if rule:
                self.identical[k] += 1
            if setting.runner.diagnostics:  # its fidelity figures are its own
                continue
            if rule or not setting.method.capabilities.compresses:
                key = donor_key(setting)
                if key in donors and rule:
                    reuse[k] = donors[key]
                donors.setdefault(key, k)
        return reuse

    def _prompt_states(self, call: Call, where: tuple[int, int, str], prompt: list[int],
                       reuse: dict[int, int], need_state: bool
                       ) -> Iterator[tuple[Group, Any, list[int]]]:
        """(group, its prompt state: what `Decoder.add` takes, its members still to answer this
        prompt), group by group, each group's shared prefill made as its turn comes (with
        `need_state` also where none of its members answers: the fidelity pass starts from it). A
        member answered before a restart takes its recorded answer instead; one identical to
        the full cache by rule waits for its donor (`_take_rule_answers`)."""
        plans = []
        for group in self.groups:
            kept = {k: self.records[k].get(*where) for k in group.members if self.records[k]}
            missing = [k for k in group.members if kept.get(k) is None]
            if self.merge and missing:
                raise ConfigError(f"merging shards: sample {where[1]} of call {where[0]} has no "
                                  f"record for {self.members[missing[0]].setting.label} (its "
                                  "shard did not finish, or the shards split the samples "
                                  "differently); run that shard again")
            todo = [k for k in missing if k not in reuse]
            fed = group.prefill_engine is not None and bool(todo or need_state)
            plans.append((group, kept, missing, todo, fed))
        ready = self._replay_eager([(g, bool(todo)) for g, _, _, todo, fed in plans if fed],
                                   prompt)
        for group, kept, missing, todo, fed in plans:
            if not missing and any(kept[k].get("shared") for k in group.members):
                group.shared_prefills += 1  # as the shard that answered it counted it
            shared = (ready.pop(id(group)) if id(group) in ready
                      else self._prefill(group, prompt, count=bool(todo)) if fed else None)
            for k in group.members:
                if kept.get(k) is not None:  # answered before a restart: counted as it was
                    sweep_records.apply(self.members[k].engine, kept[k]["tally"])
                    call.outputs[k].append(kept[k]["output"])
                    self.gained[k] = kept[k]["tally"]
            yield group, shared, todo

    def _take_rule_answers(self, call: Call, where: tuple[int, int, str],
                           reuse: dict[int, int]) -> None:
        """The members identical to the full cache by rule take their donor's answer to this
        prompt, and its accounting."""
        i = where[1]
        for k, donor in reuse.items():
            if len(call.outputs[k]) == i + 1:  # recorded before a restart
                continue
            out, gained = call.outputs[donor][i], self.gained[donor]
            sweep_records.apply(self.members[k].engine, gained)
            call.outputs[k].append(list(out))
            if self.records[k]:
                self.records[k].append(*where, out, gained)

    def _done(self, call: Call, where: tuple[int, int, str], k: int, out: list[int],
              gained: dict, shared: bool) -> None:
        """Member k's answer to this prompt, its request closed and accounted."""
        call.outputs[k].append(out)
        self.gained[k] = gained
        if self.records[k]:
            self.records[k].append(*where, out, gained, shared=shared)

    def _prefill(self, group: Group, prompt: list[int], count: bool = True):
        """The group's prompt state once the prompt is fed, before its end: (snapshot, last
        logits, what the prefill added to the prefill engine's accounting: its timed chunks,
        tokens and transfers); the recording each member replays into its own request, when
        the replayed state cannot be copied; or None when the group is one setting feeding its
        own prompt, or its state cannot be copied and it replays no forward (each member then
        prefills for itself). The state comes from the group's shared forward, replayed
        (harness.sweep.replay), or else from the group's own forward. `count`: whether it is a
        prefill of the answers (counted in `run.sweep`), not of the fidelity pass."""
        engine = group.prefill_engine
        while group.forward is not None:
            before = sweep_records.tally(engine)
            with engine.request(account=False) as req:
                recording, (logits,) = group.forward.replay(prompt, group.eager, [req])
                snapshot = None if self._diverged(group, logits) else self._snapshot(group, req)
            if not isinstance(logits, sweep_replay.Diverged):
                return self._replayed(group, snapshot, logits, before, recording, count)
        if len(group.members) == 1:
            return None
        if group.own_each:  # shown unforkable by an earlier prompt: no group prefill to check
            group.own_prefills += count
            return None
        before = sweep_records.tally(engine)
        with engine.request(account=False) as req:
            logits = req.feed_prompt(prompt)
            snapshot = _scored_snapshot(req)
        return self._handed(group, snapshot, logits, before, count)

    def _replay_eager(self, fed: list[tuple[Group, bool]], prompt: list[int]) -> dict[int, Any]:
        """The prompt states of the groups replaying an eager recording (their layers compute
        the held prompt's attention probabilities themselves), replayed together, layer by
        layer, as the recording is made, so that each layer's probabilities are computed once
        for the recording and all of them (harness.sweep.replay.record_replaying):
        id(group) -> what `_prefill` would return. `fed`:
        (group, count) for the groups whose state this prompt needs. A group that diverges is
        left to `_prefill`."""
        by_forward: dict[int, list[tuple[Group, bool]]] = {}
        for group, count in fed:
            if group.eager and group.forward is not None and not group.per_member:
                by_forward.setdefault(id(group.forward), []).append((group, count))
        ready = {}
        for together in (t for t in by_forward.values() if len(t) > 1):
            groups = [g for g, _ in together]
            befores = [sweep_records.tally(g.prefill_engine) for g in groups]
            with contextlib.ExitStack() as stack:
                reqs = [stack.enter_context(g.prefill_engine.request(account=False))
                        for g in groups]
                recording, results = groups[0].forward.replay(prompt, True, reqs)
                snapshots = [None if self._diverged(g, r) else self._snapshot(g, req)
                             for g, r, req in zip(groups, results, reqs)]
            for (group, count), logits, snapshot, before in zip(together, results, snapshots,
                                                                  befores):
                if not isinstance(logits, sweep_replay.Diverged):
                    ready[id(group)] = self._replayed(group, snapshot, logits, before,
                                                      recording, count)
        return ready

    @staticmethod
    def _diverged(group: Group, result) -> bool:
        """After a replay into the group: whether it diverged; then the group moves to the
        eager recording, or from there to a forward of its own (the reason kept)."""
        if not isinstance(result, sweep_replay.Diverged):
            return False
        if group.eager:
            group.forward, group.replay_refused = None, str(result)
        group.eager = True
        return True

    @staticmethod
    def _snapshot(group: Group, req):
        """The replayed request's prompt state to hand over, or None where each member replays
        the forward into its own request."""
        return None if group.per_member else _scored_snapshot(req)

    def _replayed(self, group: Group, snapshot, logits, before: dict, recording, count: bool):
        """What `_prefill` returns for a group whose replay went through."""
        if snapshot is None:  # replayed alike, but the state cannot be handed over
            group.per_member = True
            group.shared_prefills += count
            return recording
        # the forward's cost is its own too
        sweep_records.apply(group.prefill_engine, recording.cost)
        return self._handed(group, snapshot, logits, before, count)

    def _handed(self, group: Group, snapshot, logits, before: dict, count: bool):
        engine = group.prefill_engine
        if snapshot is None:
            group.own_prefills += count
            group.own_each = True
            return None
        group.shared_prefills += count
        return snapshot, logits, sweep_records.added(engine, before)


@dataclass
class Turn:
    """One prompt of a call while every member answers it (`SharedPass.turn`)."""

    shared: SharedPass
    call: Call
    where: tuple[int, int, str]  # (call index, prompt index, prompt key): a record's place
    reuse: dict[int, int]  # member -> the member whose answer it takes (`SharedPass._reuse`)
    decoder: Decoder
    forcing: FidelityBatch | None

    def states(self) -> Iterator[tuple[Group, Any, list[int]]]:
        """(group, its prompt state, its members still to answer), group by group
        (`SharedPass._prompt_states`)."""
        request = self.call.request
        return self.shared._prompt_states(self.call, self.where, request.prompts[self.where[1]],
                                          self.reuse, self.forcing is not None)

    def force(self, group: Group, state) -> None:
        """The group's members' fidelity requests join the batch from the same prompt state
        their answers got: one forward serves both."""
        if self.forcing is not None:
            given = functools.partial(_given, state)
            for k in group.members:
                self.forcing.add(k, self.shared.members[k].engine, given)


def _given(state, req, item) -> torch.Tensor:
    """A fidelity request (harness.core.fidelity.Start) given a copy of the prompt state its
    setting's answer got."""
    return give_prompt_state(req, item.prompt, item.query, state, consume=False, charged=False)


def _scored_snapshot(req):
    """The request's prompt state once its layers have scored the prompt (what no prompt-end
    knob changes, `KVLayer.score_prompt`: done once for the whole group), or None."""
    score_prompt(req.cache.kv_layers)
    return req.snapshot()


def evaluate(members: list[Member], groups: list[Group], copy_on_use: bool = True,
             records: list | None = None, merge: bool = False, shard=None
             ) -> Iterator[tuple[int, Any]]:
    """(member index, its TaskResult), each member as soon as its result is complete (so its
    folder can be written before the next is computed). `groups`: `plan_groups(members)`;
    `records[i]`: member i's per-sample records (harness.sweep.records), or None; `merge`:
    every answer of the shared pass is in them (the shards' merge), none is computed; `shard`
    (harness.sweep.shards.Shard): its samples answered and recorded for every member, nothing
    scored (it yields nothing: the merge does the rest).

    The task's requests are built once (`Task.requests`), answered for every member, then each
    member's answers are scored by the task's own code (`Task.score`). This loop is the sweep:
    for each request, for each prompt, for each prefill group, for each setting,
    `Decoder.add`. A member with an own-pass reason (`own_pass_reason`) is evaluated over its
    own engine (`Task.evaluate`)."""
    if groups:
        shared = SharedPass(members, groups, copy_on_use, records, shard, merge)
        task = members[shared.first].setting.task
        work = task.requests(members[shared.first].engine)
        answers: dict[int, list[Answer]] = {k: [] for k in shared.order}
        for request in work.requests:
            if isinstance(request, ScoreStreamRequest):
                answered = shared.score_stream(request)  # every setting, in lockstep
            else:
                call = shared.open_call(request)
                for i, prompt in enumerate(progress(request.prompts, request.label, "prompt")):
                    if not shared.owns(i, request):
                        shared.skip(call)  # another shard's sample
                        continue
                    query, limit = request.query(i), request.max_new_tokens[i]
                    with shared.turn(call, i) as turn:
                        for group, state, todo in turn.states():
                            for k in todo:  # one (setting, prompt)
                                turn.decoder.add(k, members[k].engine, prompt, limit, query,
                                                 state)
                            turn.force(group, state)
                answered = shared.answers(call)
            for k in shared.order:
                answers[k].append(answered[k])
        shared.note_members()
        if shard is None:
            for k in shared.order:
                yield k, task.score(members[k].engine, work, answers[k])
    if shard is None:
        for i, m in enumerate(members):
            if m.own_pass:
                yield i, m.setting.task.evaluate(m.engine)
