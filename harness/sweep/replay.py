"""One dense forward of a prompt for many methods: recorded once, replayed into each setting's
own layers (harness.sweep.execute).

Under runner.prefill=dense a layer holds the prompt in full while it is fed and attends over
all of it, so every method's forward of a prompt computes the same hidden states; what differs
is what its layers record on the way (accumulated attention, the last queries, token ids, ...).
`record_prompt` feeds the prompt once through layers that hold the full cache and keep every
call the model makes on them: the new keys and values, the attention input (`prefetch`), the
query, attention's mask, arguments and output, the attention block's input and output.
`replay_prompt` makes the same calls, in the model's order, on a setting's fresh layers, as its
own forward would, without running the model: the linear layers of a prompt are computed once
per sweep instead of once per method.

Checked, not assumed. During replay each layer's attention output must equal the recorded one
bit for bit; where it does not (a method whose layers attend otherwise while a prompt is held),
that setting's own forward would have computed other hidden states from that layer on:
`Diverged` is raised and the caller prefills that setting itself. A layer that hands attention
exactly the recorded inputs (query, keys, values, mask, arguments) gets the recorded output
without recomputing it; a layer that computes attention itself (its probabilities feed its
scores) computes it, and its result is compared. A recording is made with the model's attention
or with the eager computation of methods.scoring.attention_with_probs (`Recorder.eager`): the
sweep replays the first into every setting, and the second into those whose layers attend that
way (harness.sweep.plan.Forward).

A recording is replayed into the settings that ask for it first while it is made
(`record_replaying`): each layer's call, once the model has made it on the recorder, is replayed
into them before the model goes on to the next layer. The eager recording's probabilities of a
layer are then computed once, for the recording and every setting replaying it, instead of once
more for the settings (its time is taken out of the recording's own).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch

from harness.core import forward
from harness.core.hf_adapter import mask_sizes
from harness.core.profiling import sync
from harness.sweep import records as sweep_records
from harness.core.prompting import open_prompt
from methods.base import KVMethod
from methods.capabilities import Capabilities
from methods.layer import KVLayer
from methods.model import ModelInfo
from methods.scoring import attention_with_probs, shared_attention


class Diverged(Exception):
    """A setting's layers do not attend over a held prompt as the recording did."""


@dataclass
class LayerCall:
    """What the model gave one layer, and what attention returned, in one prefill forward."""

    keys_new: torch.Tensor | None = None  # (B, H_kv, q, D) given to `update`
    values_new: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None  # as `update` received them
    keys: torch.Tensor | None = None  # (B, H_kv, T, D) what attention saw: the prompt so far
    values: torch.Tensor | None = None
    module: Any = None  # the model's attention module
    base: Callable | None = None  # the model's attention function
    query: torch.Tensor | None = None  # (B, H_q, q, D)
    mask: torch.Tensor | None = None
    sizes: tuple[int, int, int, int] | None = None  # what the mask was made from (mask_sizes)
    kwargs: dict[str, Any] = field(default_factory=dict)
    out: torch.Tensor | None = None  # (B, q, H_q, D) attention's output
    eager: bool = False  # computed by attention_with_probs, not by `base`
    hidden: torch.Tensor | None = None  # the attention input (prefetch), with lookahead
    hidden_positions: torch.Tensor | None = None
    residual: torch.Tensor | None = None  # the attention block's input and output, observed
    block_out: torch.Tensor | None = None
    # the eager attention's inputs and result (methods.scoring.shared_attention), held only
    # until the settings replaying this call as it is recorded have taken it
    held: list | None = None


@dataclass
class Recording:
    """One prompt's dense forward: per chunk, its ids and each layer's call."""

    chunks: list[tuple[torch.Tensor, list[LayerCall]]]  # (ids (1, q), per layer)
    logits: torch.Tensor  # (1, 1, V) the prompt's last logits
    cost: dict[str, Any]  # what the forward added to its engine's accounting (sweep_records)


class _RecorderLayer(KVLayer):
    """Holds the full cache and keeps every call of the current prompt; with `replaying`, hands
    each call, once made, to the settings replayed as it is recorded (module docstring)."""

    def __init__(self, layer_idx: int, info: ModelInfo, eager: bool, observes: bool):
        super().__init__(layer_idx, info)
        self.eager, self.observes = eager, observes
        self.calls: list[LayerCall] = []  # one per forward
        self.current: LayerCall | None = None
        self.live: _PromptReplay | None = None

    def replaying(self, live: "_PromptReplay") -> None:
        """Replay every call of this request's forwards into `live` as it is made."""
        self.live = live

    def _call(self) -> LayerCall:
        if self.current is None:
            self.current = LayerCall()
            self.calls.append(self.current)
        return self.current

    def _made(self, call: LayerCall) -> None:
        """The model has made this forward's whole call on the layer."""
        if self.live is not None:
            self.live.layer(self.layer_idx, call)

    def observe_token_ids(self, ids: torch.Tensor) -> None:
        # before the model runs: the settings replayed as it is recorded start their forward
        if self.live is not None and self.layer_idx == 0:
            self.live.begin_chunk(ids)

    def prefetch(self, hidden_states, position_ids, ahead: bool) -> None:
        if not ahead:
            call = self._call()
            call.hidden, call.hidden_positions = hidden_states, position_ids

    def update(self, keys, values, position_ids):
        call = self._call()
        call.keys_new, call.values_new, call.position_ids = keys, values, position_ids
        call.sizes = mask_sizes(self, keys.shape[-2])
        self.append_kv(keys, values)
        call.keys, call.values = self.keys, self.values
        return call.keys, call.values

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        call = self._call()
        if self.eager:
            with shared_attention() as held:
                out = attention_with_probs(query, keys, values, attention_mask,
                                           kwargs["scaling"])[0]
            call.held = held if self.live is not None else None
        else:
            out = base(module, query, keys, values, attention_mask, **kwargs)[0]
        call.module, call.base, call.query, call.mask = module, base, query, attention_mask
        call.kwargs, call.out, call.eager = dict(kwargs), out, self.eager
        if not self.observes:
            self._made(call)
        return out, None

    def observe_attention_block(self, residual, attention_output) -> None:
        if not self.observes:  # another open request's hooks: no setting here reads it
            return
        call = self._call()  # copies: a model may add to its residual stream in place
        call.residual, call.block_out = residual.clone(), attention_output.clone()
        self._made(call)

    def after_forward(self) -> None:
        self.current = None
        if self.live is not None and self.next_layer is None:  # the forward's last layer
            self.live.end_chunk()


@dataclass(kw_only=True)
class Recorder(KVMethod):
    """The full cache, recording (not a user-facing method: it is never discovered)."""

    name: ClassVar[str] = "sweep_recorder"
    provenance: ClassVar[str] = "reference"
    operating_point: ClassVar[str] = "records one dense forward for the settings of a sweep"
    axis_keys: ClassVar[tuple[str, ...]] = ()
    eager: bool = False
    # layers attending with the model's attention even when `eager`: the protocol's dense
    # layers, which every method leaves to the full cache
    base_layers: tuple[int, ...] = ()
    # what the settings replaying it are called with: attention inputs one layer ahead, the
    # attention block's input and output
    lookahead: bool = False
    observes: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        # token ids: the first layer's tell the settings replayed as it records that a forward
        # starts (`record_replaying`)
        self.capabilities = Capabilities(compresses=False, lookahead=self.lookahead,
                                         observes_attention_block=self.observes,
                                         needs_token_ids=True)

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return _RecorderLayer(layer_idx, info, self.eager and layer_idx not in self.base_layers,
                              self.observes)

    make_dense_layer = make_layer  # `base_layers` already says how a dense layer attends


def recorder_for(methods: list[KVMethod], eager: bool,
                 dense_layers: tuple[int, ...] = ()) -> Recorder:
    """A recorder for settings of these methods to replay: it records what any of them is called
    with; `eager`: its attention is methods.scoring.attention_with_probs but on `dense_layers`
    (the protocol's)."""
    caps = [m.capabilities for m in methods]
    return Recorder(eager=eager, base_layers=tuple(dense_layers),
                    lookahead=any(c.lookahead for c in caps),
                    observes=any(c.observes_attention_block for c in caps))


def recording_settings(settings):
    """A recorder engine's settings from a setting's: the same forward (chunking, protocol),
    its K/V held contiguous on the device (what attention computes does not depend on it)."""
    return dataclasses.replace(settings, kv_layout="contiguous", kv_offload="none",
                               kv_device_limit_mib=None, check_budget=False,
                               diagnostics_every=0, batch_size=1)


def record_prompt(engine, prompt: list[int]) -> Recording:
    """Feed `prompt` once through `engine` (its method a `Recorder`) and keep every call."""
    return record_replaying(engine, prompt, [])[0]


def record_replaying(engine, prompt: list[int], reqs: list
                     ) -> tuple[Recording, list[torch.Tensor | Diverged]]:
    """`record_prompt`, and `replay_prompts` into `reqs` as it is made: each layer's call is
    replayed into them as soon as the model has made it on the recorder (an eager layer's
    probabilities are computed once for both). The recording's cost is its own forward's: the
    time spent replaying into `reqs` is taken out of its chunks' prefill time."""
    before = sweep_records.tally(engine)
    live = _PromptReplay(reqs, len(prompt))
    with engine.request(account=False) as req:
        layers = req.cache.kv_layers
        for kv in layers:
            kv.replaying(live)
        logits = req.feed_prompt(prompt)
        ids = torch.as_tensor(prompt, dtype=torch.long, device=engine.device)[None]
        chunk = engine.prefill_chunk()
        pieces = [ids[:, s:s + chunk] for s in range(0, ids.shape[1], chunk)]
        chunks = [(piece, [kv.calls[c] for kv in layers]) for c, piece in enumerate(pieces)]
    cost = sweep_records.added(engine, before)
    if len(cost["prefill_ms"]) != len(live.hooks_ms):
        raise RuntimeError("a recording's chunks and the forwards replayed during it differ")
    cost["prefill_ms"] = [t - h for t, h in zip(cost["prefill_ms"], live.hooks_ms)]
    return Recording(chunks, logits, cost), live.results(logits)


def replay_prompt(req, recording: Recording) -> torch.Tensor:
    """`req.feed_prompt(prompt)` from the recording: every layer of the request is called as the
    model's forward would call it, chunk by chunk (harness.core.forward: the replay computes its
    layers); returns the prompt's last logits `(1, 1, V)`. Raises `Diverged` when a layer's
    attention output differs from the recording's."""
    result = replay_prompts([req], recording)[0]
    if isinstance(result, Diverged):
        raise result
    return result


def replay_prompts(reqs: list, recording: Recording) -> list[torch.Tensor | Diverged]:
    """`replay_prompt` into several requests at once, layer by layer: each recorded layer is
    replayed into every request before the next, inside `methods.scoring.shared_attention`, so
    the settings computing a held prompt's attention probabilities (those replaying the eager
    recording) compute each layer's once. Per request, its logits or its `Diverged` (a request
    that diverged is fed nothing more; the caller drops it). Each request's engine times its own
    layers' share as its prefill."""
    live = _PromptReplay(reqs, sum(ids.shape[1] for ids, _ in recording.chunks))
    for ids, calls in recording.chunks:
        live.begin_chunk(ids)
        for layer, call in enumerate(calls):
            live.layer(layer, call)
        live.end_chunk()
    return live.results(recording.logits)


class _PromptReplay:
    """Requests replaying one prompt's forward, chunk by chunk and layer by layer as the model
    makes its calls: `begin_chunk`, then `layer` for each of the chunk's layer calls, then
    `end_chunk` (harness.core.forward's start and finish around the layers). A request whose
    attention output differs from the recording's is `failed` from then on."""

    def __init__(self, reqs: list, tokens: int):
        self.reqs = reqs
        self.failed: dict[int, Diverged] = {}
        self.lookahead = [req.engine.method.capabilities.lookahead or req.engine.tier.offload
                          for req in reqs]
        self.fed: list[int] = []  # this chunk's tokens per request (0: failed)
        self.ms: list[float] = []  # this chunk's time per request
        self.hooks_ms: list[float] = []  # per chunk, all the time spent here
        self.device = reqs[0].engine.device if reqs else torch.device("cpu")
        for req in reqs:
            open_prompt(req.kv_layers, None if req.declared_final else req.pos + tokens)
        forward.begin_step([req.engine for req in reqs], decode=False)

    def begin_chunk(self, ids: torch.Tensor) -> None:
        """A chunk's forward `ids` `(1, q)` starts: token ids first (hf_adapter.forward hands
        them over before the model runs)."""
        t_hook = time.perf_counter()
        if self.reqs:
            forward.start()
        self.fed = [0 if i in self.failed else ids.shape[1] for i in range(len(self.reqs))]
        self.ms = [0.0] * len(self.reqs)
        for i in self._live():
            t0, cache = time.perf_counter(), self.reqs[i].cache
            if cache.needs_token_ids:
                for kv in cache.kv_layers:
                    kv.observe_token_ids(ids)
            self.ms[i] += _since(t0, self.reqs[i].engine.device)
        self.hooks_ms.append(_since(t_hook, self.device))

    def layer(self, layer: int, call: LayerCall) -> None:
        """The chunk's call on `layer`, into every request not failed; inside shared_attention,
        given the recorder's own eager result where the call is replayed as it is recorded."""
        t_hook = time.perf_counter()
        with shared_attention(call.held):
            for i in self._live():
                t0, req = time.perf_counter(), self.reqs[i]
                try:
                    _replay_layer(req.cache, req.kv_layers[layer], call, self.lookahead[i],
                                  call.eager)
                except Diverged as exc:
                    self.failed[i], self.fed[i] = exc, 0
                self.ms[i] += _since(t0, req.engine.device)
        call.held = None  # taken: the probabilities are the chunk's largest tensors
        self.hooks_ms[-1] += _since(t_hook, self.device)

    def end_chunk(self) -> None:
        """The chunk's forward is over for the requests fed (the driver's finish), each timing
        its layers' share as its prefill."""
        t_hook = time.perf_counter()
        forward.finish(self.reqs, self.fed, decode=False)
        for req, took, n in zip(self.reqs, self.ms, self.fed):
            if n:
                req.engine.timer.add("prefill", [took])
        self.hooks_ms[-1] += _since(t_hook, self.device)

    def results(self, logits: torch.Tensor) -> list[torch.Tensor | Diverged]:
        """Per request, the prompt's last logits `(1, 1, V)` or its `Diverged`."""
        return [self.failed.get(i, logits.clone()) for i in range(len(self.reqs))]

    def _live(self) -> list[int]:
        return [i for i in range(len(self.reqs)) if i not in self.failed]


def _since(t0: float, device: torch.device) -> float:
    """Milliseconds since `t0` (`time.perf_counter`), the device's queued work included."""
    sync(device)
    return (time.perf_counter() - t0) * 1e3


def _replay_layer(cache, kv: KVLayer, call: LayerCall, lookahead: bool, eager: bool) -> None:
    if lookahead:
        kv.prefetch(call.hidden, call.hidden_positions, ahead=False)
        if kv.next_layer is not None:
            kv.next_layer.prefetch(call.hidden, call.hidden_positions, ahead=True)
    keys, values = cache.replay_update(kv.layer_idx, call.keys_new, call.values_new,
                                       call.position_ids)
    # a layer's mask is made from its sizes, its index, the attention function and the query:
    # at the recorder's sizes it is the recorded one (built once, and `_recorded` knows it as is)
    mask = (call.mask if cache.layer_sizes(kv.layer_idx) == call.sizes
            else cache.layer_mask(kv.layer_idx, call.base, call.query))
    base = call.base if eager else _recorded(call)
    out = kv.attend(call.module, call.query, keys, values, mask, base=base, **call.kwargs)[0]
    if not torch.equal(out, call.out):
        raise Diverged(f"layer {kv.layer_idx}: its attention over the held prompt differs from "
                       "dense attention")
    if cache.observes_attention_block:
        kv.observe_attention_block(call.residual, call.block_out)


def _recorded(call: LayerCall) -> Callable:
    """The model's attention function, answering from the recording when given exactly the
    recorded inputs (then its output is the recorded one), computing otherwise."""

    def attention(module, query, keys, values, attention_mask, **kwargs):
        if (module is call.module and _same(query, call.query) and _same(keys, call.keys)
                and _same(values, call.values) and _same(attention_mask, call.mask)
                and kwargs.keys() == call.kwargs.keys()
                and all(_same(v, call.kwargs[k]) for k, v in kwargs.items())):
            return call.out, None
        return call.base(module, query, keys, values, attention_mask, **kwargs)

    return attention


def _same(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return a == b
