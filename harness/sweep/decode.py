"""A sweep's settings decoded together (harness.sweep.execute, `runner.sweep_decode_batch`).

For one prompt, each setting's request is opened on its own engine, given its prompt state (its
copy of the shared prefill, or its own prefill), compressed at the prompt's end and fed the
query; then up to `size` such requests decode greedily together, one batched forward per step
(`harness.core.batch.decode_requests`: each request keeps its own method, cache and accounting).
The batch size is a memory knob: how many settings' caches are open at once. It changes no
answer, no score and no KV figure (each row attends its own cache with its own mask, as its
single run does; tests/harness/test_sweep_engine.py); a step's time is the batched step's.

A setting decodes alone (as `Request.answer`) when its step cannot share a forward: a
diagnostics shadow follows its own steps, or attention-block hooks are installed per request.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from harness.core import forward
from harness.sweep import records as sweep_records
from harness.sweep import replay as sweep_replay
from harness.core.batch import decode_requests


@dataclass
class Entry:
    member: int
    request: Any  # harness.core.engine.Request, open
    logits: torch.Tensor  # (1, 1, V): the prompt's (or query's) last logits
    limit: int
    before: dict[str, Any]  # its engine's tally before the request opened
    shared: bool  # its prompt state came from the group's shared prefill


def decodes_alone(engine, size: int) -> bool:
    """Whether this setting's decode steps must run as its own forwards."""
    return (size == 1 or engine.diagnostics is not None
            or engine.method.capabilities.observes_attention_block)


class Decoder:
    """One prompt's answers for every computed setting. `done(member, output, gained, shared)`
    is called once a member's request is closed and accounted (`gained`: what it added to its
    engine's accounting, harness.sweep.records). Use as a context manager: the requests still
    open when it ends are decoded then; on an error they are closed unaccounted."""

    def __init__(self, size: int, stop_ids: set[int], min_new_tokens: int,
                 done: Callable[[int, list[int], dict, bool], None], copy_on_use: bool = True):
        self.size, self.stop_ids, self.min_new_tokens = size, stop_ids, min_new_tokens
        self.done, self.copy_on_use = done, copy_on_use
        self.pending: list[Entry] = []
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> "Decoder":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.flush()
        else:
            self.stack.__exit__(kind, value, traceback)

    def add(self, member: int, engine, prompt: list[int], limit: int, query, shared) -> None:
        """Open `member`'s request: its prompt state (`shared`: the group's (snapshot, last
        logits, prefill cost); a recorded forward (harness.sweep.replay.Recording) replayed into
        the request; or None: it prefills the prompt itself), compressed, then its query fed;
        decoded now if it decodes alone or the batch is full."""
        alone = decodes_alone(engine, self.size)
        stack = contextlib.ExitStack() if alone else self.stack
        before = sweep_records.tally(engine)
        req = stack.enter_context(engine.request())
        try:
            if shared is None:
                logits = req.prefill(prompt)
            elif isinstance(shared, sweep_replay.Recording):  # replayed into this request
                logits = sweep_replay.replay_prompt(req, shared)
                sweep_records.apply(engine, shared.cost)  # the recorded forward's cost
                req.close_prompt()
            else:
                snapshot, logits, cost = shared
                req.restore(snapshot, consume=not self.copy_on_use)
                sweep_records.apply(engine, cost)  # what this prefill costs it alone
                forward.begin_step([engine], decode=False)  # the prompt's, as its prefill
                req.close_prompt()
                logits = logits.clone()
            if query:
                logits = req.prefill(query, prompt_ends=False)
        except BaseException:
            if alone:
                stack.close()
            raise
        entry = Entry(member, req, logits, limit, before, shared is not None)
        if alone:
            self._finish([entry], stack)
            return
        self.pending.append(entry)
        if len(self.pending) >= self.size:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            entries, self.pending = self.pending, []
            stack, self.stack = self.stack, contextlib.ExitStack()
            self._finish(entries, stack)

    def _finish(self, entries: list[Entry], stack: contextlib.ExitStack) -> None:
        with stack:  # closing it accounts every request (Engine.request)
            if len(entries) == 1:
                e = entries[0]
                outs = [e.request.answer(e.logits, e.limit, self.stop_ids, self.min_new_tokens)]
            else:
                outs = decode_requests([e.request for e in entries],
                                       [e.logits[0, -1] for e in entries],
                                       [e.limit for e in entries], self.stop_ids,
                                       self.min_new_tokens)
        for e, out in zip(entries, outs):
            engine = e.request.engine
            self.done(e.member, out, sweep_records.added(engine, e.before), e.shared)
