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

import abc
import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from harness.core import fidelity
from harness.core import forward
from harness.sweep import records as sweep_records
from harness.sweep import replay as sweep_replay
from harness.core.batch import Lockstep, decode_requests


@dataclass
class Entry:
    member: int
    request: Any  # harness.core.engine.Request, open
    logits: torch.Tensor  # (1, 1, V): the prompt's (or query's) last logits
    limit: int
    before: dict[str, Any]  # its engine's tally before the request opened
    shared: bool  # its prompt state came from the group's shared prefill


def give_prompt_state(req, prompt: list[int], query: list[int] | None, shared, consume: bool,
                charged: bool) -> torch.Tensor:
    """Give an open request its prompt state and feed its query; the last logits (1, 1, V).
    `shared`: the group's (snapshot, last logits, prefill cost), a recorded forward
    (harness.sweep.replay.Recording) replayed into the request, or None: it prefills the prompt
    itself. The prompt's end compresses it. `charged`: the shared prefill's cost is counted in
    the request's engine, as its own prefill would be (not for a fidelity request, whose
    engine counts nothing of the setting's)."""
    engine = req.engine
    if shared is None:
        logits = req.prefill(prompt)
    elif isinstance(shared, sweep_replay.Recording):  # replayed into this request
        logits = sweep_replay.replay_prompt(req, shared)
        if charged:
            sweep_records.apply(engine, shared.cost)  # the recorded forward's cost
        req.close_prompt()
    else:
        snapshot, logits, cost = shared
        req.restore(snapshot, consume=consume)
        if charged:
            sweep_records.apply(engine, cost)  # what this prefill costs it alone
        forward.begin_step([engine], decode=False)  # the prompt's, as its prefill
        req.close_prompt()
        logits = logits.clone()
    if query:
        logits = req.prefill(query, prompt_ends=False)
    return logits


def decodes_alone(engine, size: int) -> bool:
    """Whether this setting's decode steps must run as its own forwards."""
    return (size == 1 or engine.diagnostics is not None
            or engine.method.capabilities.observes_attention_block)


class Batched(abc.ABC):
    """Open requests gathered `size` at a time, then run together (`_run`, whose ExitStack
    closes them). Use as a context manager: the requests still open at its end are run then; on
    an error they are closed unrun."""

    def __init__(self, size: int):
        self.size = size
        self.pending: list = []
        self.stack = contextlib.ExitStack()

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.flush()
        else:
            self.stack.__exit__(kind, value, traceback)

    def _queue(self, entry) -> None:
        self.pending.append(entry)
        if len(self.pending) >= self.size:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            entries, self.pending = self.pending, []
            stack, self.stack = self.stack, contextlib.ExitStack()
            self._run(entries, stack)

    @abc.abstractmethod
    def _run(self, entries: list, stack: contextlib.ExitStack) -> None:
        """Run `entries` together; closing `stack` closes their requests."""


class Decoder(Batched):
    """One prompt's answers for every computed setting. `done(member, output, gained, shared)`
    is called once a member's request is closed and accounted (`gained`: what it added to its
    engine's accounting, harness.sweep.records). Use as a context manager: the requests still
    open when it ends are decoded then; on an error they are closed unaccounted."""

    def __init__(self, size: int, stop_ids: set[int], min_new_tokens: int,
                 done: Callable[[int, list[int], dict, bool], None], copy_on_use: bool = True):
        super().__init__(size)
        self.stop_ids, self.min_new_tokens = stop_ids, min_new_tokens
        self.done, self.copy_on_use = done, copy_on_use

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
            logits = give_prompt_state(req, prompt, query, shared, consume=not self.copy_on_use,
                                 charged=True)
        except BaseException:
            if alone:
                stack.close()
            raise
        entry = Entry(member, req, logits, limit, before, shared is not None)
        if alone:
            self._run([entry], stack)
            return
        self._queue(entry)

    def _run(self, entries: list[Entry], stack: contextlib.ExitStack) -> None:
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


# --- paired fidelity (task.fidelity_tokens) of a sweep's settings ------------------------------

@dataclass
class Forcing:
    """A setting's fidelity request on one sample, started: its prompt state given, compressed,
    the query fed."""
    key: Any  # whose record it is
    engine: Any  # the setting's engine (its fidelity engine ran the request)
    request: Any  # open, on harness.core.fidelity.quiet_engine(engine)
    logits: torch.Tensor  # (1, 1, V): the distribution before the first reference token
    snapshot: Any  # its state now, to rewind for the gold answer; None: no gold, or unforkable
    start: Any  # how it was started (harness.core.fidelity.Start): kept where the gold answer
    # needs the prompt again (an unforkable state), else None


class FidelityBatch(Batched):
    """One sample's fidelity records of many settings (harness.core.fidelity): each setting's
    request is started as its prompt state comes (`add`, a group's at a time in a sweep), then
    `size` started requests are teacher-forced together, one batched forward per token
    (harness.core.batch.Lockstep), each row its own method and cache; a batch of one, or a
    setting that decodes alone (`decodes_alone`), steps as its single run does. Batched rows
    equal single ones within the reassociation of the batched matmuls. Use as a context
    manager: the requests still open at its end are forced then."""

    def __init__(self, item, ref, size: int):
        super().__init__(size)
        self.item, self.ref = item, ref
        self.records: dict[Any, dict] = {}

    def add(self, key, engine, start) -> None:
        """Start `engine`'s request on the sample (`start`: harness.core.fidelity.Start)."""
        if decodes_alone(engine, self.size):
            self.records[key] = fidelity.sample_fidelity(engine, self.item, self.ref, start)
            return
        req = self.stack.enter_context(fidelity.quiet_engine(engine).request())
        logits = start(req, self.item)
        snapshot = req.snapshot() if self.item.gold else None
        keep = start if self.item.gold and snapshot is None else None
        self._queue(Forcing(key, engine, req, logits, snapshot, keep))

    def _run(self, entries: list[Forcing], stack: contextlib.ExitStack) -> None:
        with stack:
            rows, golds = self._forced(entries)
        for e, r, g in zip(entries, rows, golds):
            if self.item.gold and g is None:  # an unforkable state: the prompt again
                g = fidelity.gold_alone(e.engine, self.item, e.start)
            self.records[e.key] = fidelity.record(self.ref, r, g)

    def _forced(self, entries: list[Forcing]) -> tuple[list, list]:
        """The reference tokens through each request, then, rewound, the gold answer's."""
        item, reqs = self.item, [e.request for e in entries]
        starts = [e.logits for e in entries]
        rows = _steps(reqs, starts, self.ref.tokens)
        golds: list[float | None] = [None] * len(entries)
        forkable = [k for k, e in enumerate(entries) if e.snapshot is not None]
        for k in forkable:
            reqs[k].restore(entries[k].snapshot, consume=True)
        gold_rows = _steps([reqs[k] for k in forkable], [starts[k] for k in forkable],
                           item.gold) if forkable else []
        for k, got in zip(forkable, gold_rows):
            golds[k] = fidelity.gold_logprob(got, item.gold)
        return rows, golds


def _steps(reqs: list, starts: list[torch.Tensor], tokens: list[int]) -> list[torch.Tensor]:
    """`_lockstep`, or for one request its own steps, as its single run."""
    if len(reqs) == 1:
        return [fidelity.forced(reqs[0], starts[0], tokens)]
    return _lockstep(reqs, starts, tokens)


def _lockstep(reqs: list, starts: list[torch.Tensor], tokens: list[int]) -> list[torch.Tensor]:
    """Teacher-force `tokens` through every request together from its logits `starts[k]`
    (1, 1, V): per request the (len(tokens), V) distributions before each token."""
    steps = Lockstep(reqs)
    rows = [[s[0, -1].float()] for s in starts]
    everyone = list(range(len(reqs)))
    for token in tokens[:-1]:
        out = steps.step(everyone, [token] * len(reqs))
        for k in everyone:
            rows[k].append(out[k])
    return [torch.stack(r) for r in rows]


def stream_fidelity_records(engines: list, ids: torch.Tensor, prompt_tokens: int,
                            size: int) -> list[dict]:
    """Per engine, `Engine.stream_fidelity`'s record of one token stream: one full-cache pass
    stepped alone (as in a single run), the settings that can share a forward `size` at a time
    in lockstep beside it (one batched forward per token and batch), the others alone."""
    for engine in engines:
        fidelity.hold_peak(engine)
    together = [i for i, e in enumerate(engines) if not decodes_alone(e, size)]
    if len(together) < 2:
        together = []
    out: dict[int, dict] = {i: fidelity.stream_fidelity(e, ids, prompt_tokens)
                            for i, e in enumerate(engines) if i not in together}
    if together:
        out.update(zip(together, _streamed_together([engines[i] for i in together], ids,
                                                    prompt_tokens, size)))
    return [out[i] for i in range(len(engines))]


def _streamed_together(engines: list, ids: torch.Tensor, prompt_tokens: int,
                       size: int) -> list[dict]:
    final = int(ids.numel())
    ids = ids.to(engines[0].device)
    tallies = [fidelity.StreamTally() for _ in engines]
    with contextlib.ExitStack() as stack:
        full = stack.enter_context(fidelity.full_engine(engines[0]).request(final_tokens=final))
        reqs = [stack.enter_context(fidelity.quiet_engine(e).request(final_tokens=final))
                for e in engines]
        if prompt_tokens:
            full_row = full.prefill(ids[:prompt_tokens])[0, -1].float()
            for req, tally in zip(reqs, tallies):
                tally.add(full_row, req.prefill(ids[:prompt_tokens])[0, -1].float())
        chunks = [list(range(s, min(s + size, len(reqs)))) for s in range(0, len(reqs), size)]
        steps = [Lockstep([reqs[k] for k in chunk]) for chunk in chunks]
        for t in range(prompt_tokens, final - 1):
            full_row = full.step(ids[t:t + 1])[0, -1].float()
            for chunk, lockstep in zip(chunks, steps):
                rows = lockstep.step(list(range(len(chunk))), [int(ids[t])] * len(chunk))
                for j, k in enumerate(chunk):
                    tallies[k].add(full_row, rows[j])
    return [tally.record() for tally in tallies]
