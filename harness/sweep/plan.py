"""Which settings of a sweep share what (harness.sweep.execute runs the plan).

Prefill groups. Under runner.prefill=dense a layer holds the prompt in full while it is fed and
compresses it once, at its end (harness.core.prompting); what a layer has recorded by then depends on
its method's class and knobs, except the knobs a method declares it reads from the prompt's end
on only (`KVMethod.prompt_end_knobs`, e.g. the budget), and on the runner (chunking, attention,
layout, dense layers, ...; not the runner knobs read after the prompt only,
`runner.decode_interval_tokens`: a restored layer keeps its own engine's protocol). Settings
equal in all of that (their fresh layers' `KVLayer.prompt_state_key`s agree) form a group and
share one prompt state: each layer's declared per-request state (`KVLayer.fork`: K/V storage,
per-token and per-layer records; `Request.snapshot`), which every setting's layers adopt as their
own copy, keeping their own method, tier and protocol (`KVLayer.adopt`; `Request.restore`).

Identical to the full cache by rule. A sample whose whole sequence (prompt, query, new tokens)
fits a setting's token budget, where its method declares that such a budget keeps every token
(`rule_budget`), is answered once for all such settings that compute alike (same runner, same
attention kernel; a full-cache member answers first where there is one): the others take that
answer and its accounting (time, KV figures), and every setting counts those samples in
`identical_to_full` (metrics.json `run.sweep`; the report shows it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from harness.core.engine import Engine
from harness.sweep import replay as sweep_replay
from kvcore.errors import ConfigError
from methods.base import KVMethod
from methods.protocol import Protocol

# Runner keys that say where or how results are written or shown, not what is computed.
_NOT_COMPUTE = ("output_dir", "results_root", "debug", "skip_existing", "overwrite", "threads",
                "sweep_engine", "shards", "sweep_decode_batch")
# Runner keys read only once a prompt is over (each setting's own engine and layers apply them
# after the shared prefill is handed over): they never split a prefill group.
_AFTER_PROMPT = ("decode_interval_tokens",)


@dataclass
class Member:
    """One setting of the sweep and its engine."""

    setting: Any  # harness.session.Setting
    engine: Engine
    # why it is evaluated by its own task pass (a task needing a live engine, batches, a device
    # limit: `own_pass_reason`), or None: its answers come from the shared pass
    own_pass: str | None = None
    # samples whose sequence fits the method's rule budget (rule_budget): the full cache's
    # answer, computed once per sample; None: its method has no such rule, or its own pass
    identical_to_full: int | None = None
    decode_batch: int = 1  # settings its decode steps ran with, at most (harness.sweep.decode)

    def __post_init__(self) -> None:
        self.own_pass = self.own_pass or own_pass_reason(self.setting)


@dataclass
class Group:
    """Settings whose layers record the same state while a prompt is fed."""

    members: list[int]  # indices into the sweep's members
    prefill_engine: Engine | None = None  # None: one member, it prefills for itself
    shared_prefills: int = 0  # prompts prefilled once for the group
    own_prefills: int = 0  # prompts whose state could not be copied: each member prefilled
    # the dense forward it replays (harness.sweep.replay) instead of running its own; None: its
    # own forward (its runner feeds prompts otherwise, or its layers attended otherwise)
    forward: "Forward | None" = None
    eager: bool = False  # replays the forward's eager recording (Forward)
    replay_refused: str | None = None  # why its layers could not replay the recorded forward
    # its prompt state cannot be copied (a host-tier store, another object of its own): each
    # member replays the forward into its own request, once the group's replay of the prompt
    # has shown that its layers attend as the recording did
    per_member: bool = False
    # its prompt state cannot be copied and it replays no forward: once its first prefill
    # has shown it, each member prefills every prompt itself (no group prefill to check)
    own_each: bool = False
    streams: int = 0  # token streams its members were scored on (SharedPass.score_stream)


class Forward:
    """One dense forward per prompt for the groups replaying it (harness.sweep.replay): their
    settings share the runner. Two recordings of a prompt at most, each made only when a group
    replays it: with the model's attention (every group starts there) and with the eager
    attention of methods computing probabilities (a group whose layers attended otherwise moves
    there)."""

    def __init__(self, lead: Engine, methods: list[KVMethod]):
        self.lead, self.methods = lead, methods
        self.engines: dict[bool, Engine] = {}  # eager -> its recorder engine
        self.prompt: list[int] | None = None  # the prompt recorded now
        self.recordings: dict[bool, sweep_replay.Recording] = {}
        self.recorded = {False: 0, True: 0}  # prompts recorded, per kind

    def replay(self, prompt: list[int], eager: bool, reqs: list
               ) -> tuple["sweep_replay.Recording", list]:
        """The prompt's recording (`eager`: the eager one) and its replay into `reqs`: per
        request, its last logits or its `Diverged` (harness.sweep.replay.replay_prompts). A
        recording not held yet is made now, replayed into `reqs` as it is made."""
        if prompt != self.prompt:
            self.release()  # one prompt's recordings held at a time
            self.prompt = prompt
        if eager in self.recordings:
            recording = self.recordings[eager]
            return recording, sweep_replay.replay_prompts(reqs, recording)
        if eager not in self.engines:
            lead = self.lead
            self.engines[eager] = Engine(
                lead.model, lead.tokenizer,
                sweep_replay.recorder_for(self.methods, eager,
                                          lead.settings.protocol.dense_layers),
                lead.info, sweep_replay.recording_settings(lead.settings))
        recording, results = sweep_replay.record_replaying(self.engines[eager], prompt, reqs)
        self.recordings[eager] = recording
        self.recorded[eager] += 1
        return recording, results

    def release(self) -> None:
        self.prompt, self.recordings = None, {}


def shares_prefill(setting) -> bool:
    """Whether this setting's runner feeds a prompt the one way a prefill can be shared: dense,
    one sequence at a time, no device limit, no host tier, no diagnostics shadow."""
    r = setting.runner
    return (r.prefill == "dense" and r.batch_size == 1 and r.kv_device_limit_mib is None
            and r.kv_offload == "none" and not r.diagnostics)


def prefill_key(setting) -> str:
    """Settings with equal keys record the same state while a dense prompt is fed."""
    method = setting.method
    knobs = {k: v for k, v in method.hyperparameters().items()
             if k not in method.prompt_end_knobs}
    runner = {k: v for k, v in setting.runner.as_dict().items()
              if k not in _NOT_COMPUTE and k not in _AFTER_PROMPT}
    return json.dumps([method.name, knobs, runner], sort_keys=True, default=str)


def rule_budget(method: KVMethod) -> int | None:
    """The budget B under which `method`, as configured, keeps every token of any sequence of
    up to B tokens by its own rule, or None. It has one when it is exactly the configuration
    the contract test holds to equal the full cache: its defaults with
    `lossless_hyperparameters(B)`, B a budget knob counted in tokens (an axis knob `*_tokens`).
    Ratio budgets, quantizers (bits on their axis), knobs moved off that configuration and the
    references have none."""
    from methods import build_method

    if not method.capabilities.compresses:
        return None
    knobs = method.hyperparameters()
    for name in method.axis_keys:
        budget = knobs.get(name)
        if not name.endswith("_tokens") or not isinstance(budget, int) or isinstance(budget, bool):
            continue
        declared = type(method).lossless_hyperparameters(budget)
        if name not in declared:
            continue
        try:
            ruled = build_method(method.name, **declared).hyperparameters()
        except ConfigError:
            continue
        if ruled == knobs:
            return budget
    return None


def donor_key(setting) -> str:
    """Settings with equal keys compute a full cache's answer with the same arithmetic: the
    same runner (what it computes) and the same attention kernel."""
    runner = {k: v for k, v in setting.runner.as_dict().items() if k not in _NOT_COMPUTE}
    return json.dumps([runner, setting.method.capabilities.needs_attn_scores], sort_keys=True,
                      default=str)


def prompt_states_agree(lead: KVMethod, other: KVMethod, info, protocol: Protocol) -> bool:
    """Whether `other`'s fresh layers record the prompt state `lead`'s record (each layer's
    `KVLayer.prompt_state_key`, equal and known for every layer), so that a state forked from
    `lead`'s layers is adopted by `other`'s."""
    from harness.core.hf_adapter import MethodCache

    mine = [kv.prompt_state_key() for kv in MethodCache(lead, info, None, protocol).kv_layers]
    theirs = [kv.prompt_state_key() for kv in MethodCache(other, info, None, protocol).kv_layers]
    return None not in mine and mine == theirs


def plan_groups(members: list[Member], info) -> list[Group]:
    """Prefill groups of the members evaluated in the shared pass (see the module docstring)."""
    groups: list[Group] = []
    leads: dict[str, Group] = {}
    for i, m in enumerate(members):
        if m.own_pass:
            continue
        key = prefill_key(m.setting) if shares_prefill(m.setting) else None
        group = leads.get(key) if key is not None else None
        if group is not None:
            lead = members[group.members[0]]
            if prompt_states_agree(lead.setting.method, m.setting.method, info,
                                   m.engine.settings.protocol):
                group.members.append(i)
                continue
        group = Group([i])
        groups.append(group)
        if key is not None and key not in leads:
            leads[key] = group
    _share_forwards(members, groups)
    for group in groups:
        if len(group.members) > 1 or group.forward is not None:
            lead = members[group.members[0]].engine
            group.prefill_engine = Engine(lead.model, lead.tokenizer, lead.method, lead.info,
                                          lead.settings)
    return groups


def forward_key(setting) -> str | None:
    """Settings with equal keys compute the same dense forward of a prompt (harness.sweep.replay:
    the same runner), or None: it feeds prompts otherwise."""
    if not shares_prefill(setting):
        return None
    runner = {k: v for k, v in setting.runner.as_dict().items()
              if k not in _NOT_COMPUTE and k not in _AFTER_PROMPT}
    return json.dumps(runner, sort_keys=True, default=str)


def _share_forwards(members: list[Member], groups: list[Group]) -> None:
    """Groups whose settings compute the same dense forward replay one recording of it."""
    by_key: dict[str, list[Group]] = {}
    for group in groups:
        key = forward_key(members[group.members[0]].setting)
        if key is not None:
            by_key.setdefault(key, []).append(group)
    for same in by_key.values():
        if len(same) > 1:
            methods = [members[k].setting.method for g in same for k in g.members]
            forward = Forward(members[same[0].members[0]].engine, methods)
            for group in same:
                group.forward = forward
                lead = members[group.members[0]].setting.method
                group.eager = lead.capabilities.eager_prompt_attention


def needs_own_pass(setting) -> bool:
    """Whether the setting's runner has it evaluated by its own task pass (prompts decoded
    together, a device KV limit queueing requests), outside the shared one."""
    return (setting.runner.batch_size != 1
            or setting.runner.kv_device_limit_mib is not None)


def own_pass_reason(setting) -> str | None:
    """Why the setting is evaluated by its own task pass over its own engine, or None."""
    runner = setting.runner
    if setting.task.needs_live_engine:
        return (f"task={setting.task_name} asks its engine for requests of its own "
                "(Task.needs_live_engine): evaluated per setting, no prefill shared")
    if runner.batch_size != 1:
        return f"runner.batch_size={runner.batch_size} decodes its prompts together"
    if runner.kv_device_limit_mib is not None:
        return f"runner.kv_device_limit_mib={runner.kv_device_limit_mib} queues its requests"
    return None
