"""What a layer is: `KVLayer`, the per-request, per-layer KV state every method's layer extends
(the kept K/V and whatever a method needs), `FullLayer` (the full cache, the default layer) and
`exact_attention` (the full cache's one arithmetic). A layer never imports transformers:
`harness.core.hf_adapter` bridges it to the model's cache and attention seams, so a method file stays
plain torch.

Shapes: keys/values `(B, H_kv, T, D)`, query `(B, H_q, q_len, D)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from kvcore.offload import KV_PARTS, HostKVStore, host_capacity, host_store
from kvcore.paged import PagedRows
from kvcore.storage import ContiguousRows, HeadBlocks, Rows, grown_capacity
from methods.kernels import ragged_attention, ragged_attention_cpu
from methods.model import ModelInfo
from methods.protocol import Protocol
from methods.scoring import plain_attention, plain_decode_row

AttentionFn = Callable[..., tuple[torch.Tensor, Any]]


@dataclass
class LayerState:
    """A copy of one layer's per-request state (`KVLayer.fork`), restored by `KVLayer.adopt`
    into a layer of the same class: `values` maps each declared state attribute to its copy
    (`ABSENT` for one the layer had not set yet)."""

    layer_type: type
    values: dict[str, Any]


ABSENT = object()  # a declared state attribute the layer has not set (yet)
UNFORKABLE = object()  # what `copy_state` gives for a value it cannot copy
# immutable values, shared by a copy as they are
_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device, Protocol)


def copy_state(value, copy: bool = True):
    """A copy of one state value safe to mutate independently (tensors cloned, `Rows` forked by
    their layout, containers rebuilt), or UNFORKABLE for any other object (a host store, an
    in-flight transfer). `copy=False`: tensors and storage handed over as they are."""
    if isinstance(value, torch.Tensor):
        return value.clone() if copy else value
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, Rows):
        return value.fork() if copy else value
    if isinstance(value, (list, tuple)):
        items = [copy_state(v, copy) for v in value]
        if any(v is UNFORKABLE for v in items):
            return UNFORKABLE
        if isinstance(value, list):
            return items
        if hasattr(type(value), "_make"):  # a namedtuple (KIVI's packed parts) keeps its type
            return type(value)._make(items)
        return tuple(items)
    if type(value) is dict:
        items = {k: copy_state(v, copy) for k, v in value.items()}
        return UNFORKABLE if any(v is UNFORKABLE for v in items.values()) else items
    return UNFORKABLE


def describe_state(value):
    """A fresh state value as a comparable key (tensors by dtype, shape and content, storage
    only when empty), or UNFORKABLE for what cannot be described that way."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), tuple(value.flatten().tolist()))
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, Rows):
        return ("rows", type(value).__name__) if value.length == 0 else UNFORKABLE
    if isinstance(value, (list, tuple)):
        items = tuple(describe_state(v) for v in value)
        return UNFORKABLE if any(v is UNFORKABLE for v in items) else (type(value).__name__, items)
    if type(value) is dict:
        items = tuple((k, describe_state(v)) for k, v in value.items())
        return UNFORKABLE if any(v is UNFORKABLE for _, v in items) else ("dict", items)
    return UNFORKABLE


class KVLayer:
    """Per-request, per-layer KV state. It stores everything (the full cache), `update` returns
    the stored K/V as tensors and `attend` calls the model's attention: the base every method's
    layer extends. A method's default layer is `FullLayer` (the same storage, decode rows read
    in place).

    Contract (checked by tests on eager attention and chunked prefill):
      * `seen_tokens` counts every token ever given to `update` (positions never depend on how
        many were evicted);
      * `mask_sizes(q_len)` is called before `update` and describes what `update` will return:
        `(kept + q_len, seen - kept)`;
      * `update()` returns the K/V to attend over this step (kept + new).

    What a layer holds is of two kinds. Its per-request state, declared by name in
    `state_fields` (each class names the attributes it adds; `state_names()` gathers them over
    the class hierarchy), is what `fork` copies and `adopt` restores (a request rewound, a sweep
    handing one prompt state to each setting). Everything else is set when it is built (from
    its method and the model's info) or bound by the request (tier, protocol, next layer) and
    stays the adopting layer's own (tests/methods/contract/test_fork.py holds every other
    attribute to its fresh value after a request).
    """

    # `host`: the layer's host store (KVLayer.host_kv), per request; a store holding rows is
    # not copied, so a layer on the host tier never forks (its prompt state is replayed)
    state_fields: ClassVar[tuple[str, ...]] = ("seen_tokens", "_kv", "prompt_open",
                                               "final_tokens", "host")
    # Why this layer's state is never forked (held on the host tier, in flight); None: it is
    # forked whenever every declared state value can be copied (`copy_state`).
    unforkable: ClassVar[str | None] = None

    def __init__(self, layer_idx: int, info: ModelInfo):
        self.layer_idx = layer_idx
        self.info = info
        self.seen_tokens = 0
        # K and V as `Rows` (kvcore.storage), created at the first write in the run's layout
        # (runner.kv_layout, via the tier): a decode step writes its row in place instead of
        # concatenating (copying) the whole cache. See `keys` / `values`.
        self._kv: dict[str, Rows] = {}
        # K/V (or values only) on the host tier: the layer's one host store, made by `host_kv`
        self.host: HostKVStore | None = None
        # The request's context, set once by the cache that builds its layers
        # (harness.core.hf_adapter.MethodCache) right after `make_layer`, whose signature a method
        # keeps free of it: the request's kvcore.offload.Tier (placement, ledger, side stream),
        # the run's Protocol, and the following layer (built after this one).
        self.tier = None
        self.protocol = Protocol()
        self.next_layer: KVLayer | None = None
        # Per-prompt state, set by harness.core.prompting.open_prompt / close_prompt: a prompt is
        # being fed, and the length a ratio budget is a fraction of (budget_basis="final").
        self.prompt_open = False
        self.final_tokens: int | None = None

    # --- per-request state: fork / adopt -------------------------------------------------------
    @classmethod
    def state_names(cls) -> tuple[str, ...]:
        """Every per-request state attribute of this class: each class's own `state_fields`,
        base classes first."""
        names: list[str] = []
        for klass in reversed(cls.__mro__):  # each class's own declaration, not an inherited one
            for name in vars(klass).get("state_fields", ()):
                if name not in names:
                    names.append(name)
        return tuple(names)

    def fork(self) -> LayerState | None:
        """A copy of this layer's per-request state, or None when it cannot be copied
        (`fork_refusal` says why; the caller then feeds the prompt again)."""
        return self._forked()[0]

    def fork_refusal(self) -> str | None:
        """Why `fork` returns None now, or None when it copies the state."""
        return self._forked()[1]

    def _forked(self) -> tuple[LayerState | None, str | None]:
        kind = type(self).__name__
        if self.unforkable is not None:
            return None, f"{kind}: {self.unforkable}"
        values = {}
        for name in self.state_names():
            value = copy_state(getattr(self, name)) if hasattr(self, name) else ABSENT
            if value is UNFORKABLE:
                return None, (f"{kind}.{name} holds a {type(getattr(self, name)).__name__}, "
                              "which is not copied")
            values[name] = value
        return LayerState(type(self), values), None

    def adopt(self, state: LayerState, consume: bool = False) -> None:
        """Take `state` (`fork` of a layer of this class, this request's or another engine's) as
        this layer's own; `consume=True` hands its tensors over instead of copying them (the
        state is not used again). What is not state (method, info, tier, protocol, next layer)
        stays this layer's. K/V stored in another engine's block pools are rewritten into this
        engine's (its pool figures count them)."""
        if state.layer_type is not type(self):
            raise ValueError(f"a {state.layer_type.__name__} state restores into a layer of its "
                             f"class, not a {type(self).__name__}")
        for name, value in state.values.items():
            if value is ABSENT:
                if hasattr(self, name):
                    delattr(self, name)
            elif name == "_kv":
                setattr(self, name, {n: self._own_rows(n, rows, consume)
                                     for n, rows in value.items()})
            else:
                setattr(self, name, copy_state(value, copy=not consume))

    def _own_rows(self, name: str, rows: Rows, consume: bool) -> Rows:
        """`rows` as this layer's K/V storage: paged rows of another engine's pools are rewritten
        into this layer's pool, anything else forked (or handed over when consumed)."""
        paged = getattr(self.tier, "paged", None)
        if paged is None or not isinstance(rows, PagedRows) \
                or rows.pool is paged.pool(self.layer_idx, name):
            return rows if consume else rows.fork()
        mine = paged.rows(self.layer_idx, name)
        if rows.view() is not None:
            mine.assign(rows.view(), rows.lengths() if rows.ragged else None)
        return mine

    def prompt_state_key(self) -> tuple | None:
        """What the state this fresh layer records while a dense prompt is fed depends on beyond
        its method's knobs (read by harness.sweep.plan.prefill_key): the layer's class and
        place and its fresh state. Fresh layers of two settings with equal prefill keys and
        equal prompt-state keys record the same prompt state, so one's `fork` is the other's.
        None: this layer cannot tell (its settings each feed their own prompts)."""
        state = []
        for name in self.state_names():
            value = describe_state(getattr(self, name)) if hasattr(self, name) else ABSENT
            if value is UNFORKABLE:
                return None
            state.append((name, "absent" if value is ABSENT else value))
        return type(self), self.layer_idx, tuple(state)

    # --- protocol (read by every method alike) ------------------------------------------------
    def holding_prompt(self) -> bool:
        """True while a prompt is fed under `runner.prefill=dense`: it is held and attended in
        full, and compressed once, at `on_prefill_end` (never after a prefill chunk)."""
        return self.prompt_open and self.protocol.prefill == "dense"

    def basis_tokens(self, seen: int | None = None) -> int | None:
        """The length a ratio budget is a fraction of now (Protocol.budget_basis): the
        sequence's final length ("final", set by the engine; None until a prompt is fed or a
        stream declares it), or the tokens seen ("seen"; `seen` overrides `seen_tokens` for a
        layer sizing a step before its update). Pass it to `budget_for`."""
        if self.protocol.budget_basis == "seen":
            return self.seen_tokens if seen is None else seen
        return self.final_tokens

    # --- stored K/V (the default storage; subclasses read and assign these) -------------------
    def kv_rows(self, name: str, growth: Callable[[int, int], int] = grown_capacity) -> Rows:
        """The storage of `name` ("keys", "values"), created in the run's layout on first use:
        paged when the tier carries block pools (runner.kv_layout=paged), else contiguous with
        `growth` sizing its buffer."""
        rows = self._kv.get(name)
        if rows is None:
            paged = getattr(self.tier, "paged", None)
            rows = paged.rows(self.layer_idx, name) if paged is not None else ContiguousRows(growth)
            self._kv[name] = rows
        return rows

    @property
    def keys(self) -> torch.Tensor | None:
        """The stored keys `(B, H_kv, T, D)`: contiguous layout: a view of the valid rows of the
        buffer (writes to it are stored); paged: a gather of the blocks into a fresh tensor
        (read-only; write through `kv_rows("keys").write_at`). Assigning replaces the content:
        contiguous: the tensor becomes the buffer (no copy); paged: blocks beyond its length
        are freed and the rest rewritten."""
        rows = self._kv.get("keys")
        return None if rows is None else rows.view()

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self.kv_rows("keys").assign(tensor)

    @property
    def values(self) -> torch.Tensor | None:
        """The stored values `(B, H_kv, T, D)` (as `keys`)."""
        rows = self._kv.get("values")
        return None if rows is None else rows.view()

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self.kv_rows("values").assign(tensor)

    def host_kv(self, parts: tuple[str, ...] = KV_PARTS,
                growth: Callable[[int, int], int] = host_capacity) -> HostKVStore:
        """The layer's rows on the host tier (`parts`: K and V, or values only), made at the
        first call in the run's layout (kvcore.offload.host_store; `growth` sizes a contiguous
        store's buffers): the one place a layer keeps K/V on the host, so its bytes moved go
        through the tier's ledger and its bytes held are `host.nbytes()`. Made on first use: the
        tier is set after the layer is built."""
        if self.host is None:
            self.host = host_store(self.tier, self.layer_idx, parts, growth)
        return self.host

    def storage_stats(self) -> dict[str, int]:
        """The K/V storage's figures for the waste accounting (harness.core.accounting):
        `kv_bytes_used` (valid tokens) and `kv_bytes_allocated` (with the unused capacity or
        block slots); empty without stored K/V."""
        if not self._kv:
            return {}
        return {"kv_bytes_used": sum(rows.used_bytes() for rows in self._kv.values()),
                "kv_bytes_allocated": sum(rows.allocated_bytes() for rows in self._kv.values())}

    def release(self) -> None:
        """Give the storage back (paged: blocks return to the pool; the host store's buffers
        too); called when a request ends."""
        for rows in self._kv.values():
            rows.release()
        if self.host is not None:
            self.host.release()

    # --- cache seam -------------------------------------------------------------------------
    def update(self, keys: torch.Tensor, values: torch.Tensor, position_ids: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new K/V `(B, H_kv, q_len, D)` and return what attention sees this step."""
        self.append_kv(keys, values)
        return self.keys, self.values

    def append_kv(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append the new K/V `(B, H_kv, q_len, D)` to the stored rows (ragged rows: after each
        head's own tokens) and count them as seen."""
        self.seen_tokens += keys.shape[-2]
        self.kv_rows("keys").append(keys)
        self.kv_rows("values").append(values)

    def kept_tokens(self) -> int:
        """Tokens stored now (before the next update)."""
        rows = self._kv.get("keys")
        return 0 if rows is None else rows.length

    def mask_sizes(self, q_len: int) -> tuple[int, int]:
        kept = self.kept_tokens()
        return kept + q_len, self.seen_tokens - kept

    def prefetch(self, hidden_states: torch.Tensor, position_ids: torch.Tensor | None,
                 ahead: bool) -> None:
        """Called before this layer's attention (`ahead=False`, with this layer's input) and one
        layer earlier (`ahead=True`, with the previous layer's attention input x_{i-1}), so a
        method can speculate and start moving K/V while the previous layer still computes.
        Only called for methods with `lookahead` or when the runner offloads the KV."""

    def observe_attention_block(self, residual: torch.Tensor,
                                attention_output: torch.Tensor) -> None:
        """Called after this layer's attention block at every forward, for methods declaring
        `observes_attention_block`: `residual` is the decoder layer's input (the residual stream
        before its norm) and `attention_output` what the attention block adds to it (after the
        output projection), both `(B, q_len, hidden)`."""

    def observe_token_ids(self, ids: torch.Tensor) -> None:
        """Called before every forward for methods declaring `needs_token_ids`: the ids `(B, q)`
        whose K/V this layer's next `update` receives (a prefill chunk, a decode step; in a batch,
        this sequence's real ids only, so `q` is its own count)."""

    def attended_tokens(self) -> int:
        """Tokens the last decode step attended to (for the density / relative-KV-size figure)."""
        return self.kept_tokens()

    def after_forward(self) -> None:
        """Called by the engine after every model forward: evict here (attention has run), unless
        `holding_prompt()` (the prompt is compressed once, at `on_prefill_end`)."""

    def score_prompt(self) -> None:
        """Called for every layer, in order, once a prompt has been fed in full and before any
        `on_prefill_end`: the prompt's-end work that reads no prompt-end knob
        (`KVMethod.prompt_end_knobs`), such as KVzip's reconstruction scores. A sweep calls it
        once for the settings sharing a prompt state and hands each its copy, so it must leave
        that state equal for all of them (recompute in `on_prefill_end` what a knob changes);
        called again, it does nothing."""

    def on_prefill_end(self) -> None:
        """Called once after each prompt has been fed in full (whatever the chunking), before the
        first decode step: every method that compresses a prompt does it here under
        `runner.prefill=dense` (`holding_prompt()` was true for the prompt's forwards)."""

    def kept_positions(self) -> torch.Tensor:
        """Text positions of the tokens attention used at the last step, `(B, H_kv, T)` (or (T,)).

        Non-evicting layers keep every position; eviction/selection methods override this.
        """
        return torch.arange(self.kept_tokens())

    # --- attention seam ---------------------------------------------------------------------
    def attend(self, module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               attention_mask: torch.Tensor | None, base: AttentionFn, **kwargs):
        """Attention over what `update` returned; `base` is the model's own attention function."""
        return base(module, query, keys, values, attention_mask, **kwargs)

    # --- accounting -------------------------------------------------------------------------
    def allowed_tokens(self) -> int | None:
        """Most tokens this layer may hold (or, for selection methods, attend) now under the
        method's budget; None: unbounded. Checked by the engine after every forward."""
        return None

    def facts(self) -> dict[str, float]:
        """What this layer's method chose for the request, as numbers to sum (e.g. FastGen's
        heads per policy), read when the request ends: summed over the request's layers, then
        averaged over requests into metrics.json `kv.method_facts` (harness.core.accounting)."""
        return {}

    def stats(self) -> dict[str, int]:
        """Tokens and bytes really held by this layer now (per KV head, tokens are the max).

        Selection methods (which keep everything but attend to a subset) add `selected_tokens`:
        the most tokens attended at one step; the budget is then checked against it. Methods
        holding part of their state on the host tier add `kv_bytes_device` (the compute-device
        share of `kv_bytes`). `kv_bytes` counts the valid tokens only; layers storing K/V in
        `Rows` add `storage_stats()`: `kv_bytes_used` and `kv_bytes_allocated` (including unused
        capacity or block slots).
        """
        storage = self.storage_stats()
        keys = self._kv.get("keys")
        return {"kv_tokens": 0 if keys is None else keys.length,
                "kv_bytes": storage.get("kv_bytes_used", 0),
                "kv_bytes_used": 0, "kv_bytes_allocated": 0, **storage}


class FullLayer(KVLayer):
    """The full cache, the default layer (`KVMethod.make_layer` / `make_dense_layer`): KVLayer's
    storage, with decode steps that attend over the stored rows where they are
    (`Rows.in_place`: the contiguous buffer, or the paged blocks through per-head block tables —
    no gather), one methods.kernels.ragged_attention call per layer and step: the C kernel on CPU
    (fp32, both layouts, so paged and contiguous give the same bits), Triton on CUDA for the paged
    layout (contiguous keeps SDPA's fused kernels there). Everything else — prefill chunks, masked
    or non-plain calls (sliding windows, soft-capping, eager's explicit mask), dtypes or devices
    no kernel serves — takes `base` over `keys` / `values`, as KVLayer does.

    `update` then returns `kvcore.storage.HeadBlocks` instead of tensors (only this class's
    `attend` receives them; subclasses of KVLayer keep getting tensors)."""

    def update(self, keys, values, position_ids):
        self.append_kv(keys, values)
        if keys.shape[-2] == 1 and self.reads_in_place(keys):
            blocks = self._kv["keys"].in_place(), self._kv["values"].in_place()
            if None not in blocks:
                return blocks
        return self.keys, self.values

    def reads_in_place(self, keys: torch.Tensor) -> bool:
        """Whether this decode step's attention reads the rows in place (see the class)."""
        if self.layer_idx in self.info.sliding_window_layers:  # the window mask: base
            return False
        if keys.device.type == "cpu":
            return keys.dtype == torch.float32 and ragged_attention_cpu.library() is not None
        return keys.is_cuda and getattr(self.tier, "paged", None) is not None

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        if isinstance(keys, HeadBlocks) and not plain_decode_row(query, attention_mask, kwargs):
            keys, values = self.keys, self.values  # a masked or non-plain call: the tensors
        return exact_attention(module, query, keys, values, attention_mask, base, **kwargs)


def exact_attention(module, query: torch.Tensor, keys, values, attention_mask, base: AttentionFn,
                    **kwargs):
    """The full cache's attention, one arithmetic for every layer that attends to everything it
    holds (FullLayer, the host-tier full cache, a lossless method's exact path), so they give
    the same bits.

    `keys`/`values` are `(B, H_kv, T, D)` tensors or rows read in place (`HeadBlocks`, ragged or
    not). Rows in place always go through methods.kernels.ragged_attention: causal attention per
    head over its own tokens (the chunk's q tokens last; the model's mask for a sequence alone
    is that causal mask, rebuilt per head), plain calls only (no window, soft-capping, sinks:
    ValueError). Tensors: a plain decode row (`methods.scoring.plain_decode_row`) in fp32 on the
    CPU goes through the same kernel when it is built; anything else through `base`."""
    blocks = isinstance(keys, HeadBlocks)
    if blocks and not plain_attention(kwargs):
        raise ValueError("rows read in place attend with plain causal attention only (no "
                         "sliding window, soft-capping or sinks); pass tensors to the model's")
    if blocks or (plain_decode_row(query, attention_mask, kwargs) and keys.device.type == "cpu"
                  and keys.dtype == values.dtype == torch.float32
                  and ragged_attention_cpu.library() is not None):
        if not blocks:
            keys, values = HeadBlocks.of(keys), HeadBlocks.of(values)
        scaling = kwargs.get("scaling")
        scaling = module.scaling if scaling is None else scaling
        return ragged_attention.ragged_attention(query, keys, values, scaling), None
    return base(module, query, keys, values, attention_mask, **kwargs)
