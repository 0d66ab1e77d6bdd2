"""A selecting layer's tokens on the host tier, only the chosen rows moved, one layer ahead.

The selection template (methods/selection.py) keeps every token on the device. A layer that
chooses before its attention (from the previous layer's input, at `prefetch`) may instead hold
them on the host (`on_host`, kvcore.offload): once the previous layer's attention is queued
(`attend` calls the next layer's `launch_fetch`), the rows it chose (`rows_to_fetch`) are
gathered on the host and copied to the device on the tier's side stream, overlapping the
previous layer's remaining compute; its `update` returns those rows + the new tokens
(`mask_sizes` says so) and `attend` gets them (the rows' text order is the method's). A forward
with nothing chosen (a prompt, a dense layer or step) gets every stored row: fetched whole,
ahead where the layer started it (`fetch_all`). The rows and the fetch in flight are the
layer's host store's (`KVLayer.host_kv`). Off the host, every token stays in the layer's default
storage and the same rows are masked instead.
"""

from __future__ import annotations

import torch

from methods.scoring import gather_tokens


class HostTierLayer:
    """Mixin of a selecting layer (before SelectionLayer in the bases); the layer writes
    `rows_to_fetch`, `_attend` (its attention) and `hold_extra` (what else it stores per
    token)."""

    def init_host(self, on_host: bool) -> None:
        self.system = on_host
        self.fetched: torch.Tensor | None = None  # (B, H_kv, n) slots moved for this step

    @property
    def pending(self) -> tuple | None:
        """The host store's fetch in flight (transfers of K and V), if any."""
        return None if self.host is None else self.host.pending

    def rows_to_fetch(self) -> torch.Tensor | None:
        """`(B, H_kv, n)` slots this decode step attends (may read the count: the step's one host
        sync), or None: every stored row."""
        return None

    def launch_fetch(self) -> None:
        """Start moving the chosen rows (host tier only; once per step)."""
        if not self.system or self.pending is not None:
            return
        rows = self.rows_to_fetch()
        if rows is not None:
            self.fetched = rows
            self.host.prefetch(rows)

    def fetch_all(self) -> None:
        """Start moving every stored row (a forward attending them all)."""
        if self.system and self.host is not None:
            self.host.prefetch()

    def mask_sizes(self, q_len: int) -> tuple[int, int]:
        if self.system and q_len == 1:
            self.launch_fetch()  # idempotent; asked right before update
            if self.fetched is not None:
                n = self.fetched.shape[-1]
                return n + q_len, self.seen_tokens - n
        return super().mask_sizes(q_len)

    def update(self, keys, values, position_ids):
        q_len = keys.shape[2]
        past = self.past_rows(q_len)
        self.seen_tokens += q_len
        self.hold(keys, values)
        if past is not None:
            keys, values = torch.cat([past[0], keys], dim=2), torch.cat([past[1], values], dim=2)
        self._attended = keys.shape[2]
        return keys, values

    def past_rows(self, q_len: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What this step attends before its new tokens: the fetched rows, or every stored row."""
        if not self.system:
            return (self.keys, self.values) if self.keys is not None else None
        if q_len == 1:
            self.launch_fetch()
        if self.host is None:
            return None
        if self.host.pending is None:  # nothing chosen: every stored row
            self.fetched = None
        pending = self.host.take()
        return None if pending is None else (pending[0].wait(), pending[1].wait())

    def hold(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the new K/V `(B, H_kv, q, D)` on the layer's tier, then `hold_extra`."""
        if self.system:
            self.host_kv().append(keys, values)
        else:
            self.kv_rows("keys").append(keys)
            self.kv_rows("values").append(values)
        self.hold_extra(keys)

    def hold_extra(self, keys: torch.Tensor) -> None:
        """What the layer stores per new token besides its K/V."""

    def keep_held(self, index: torch.Tensor) -> None:
        """Keep only the stored rows `index (B, H_kv, n)` (ascending) on the layer's tier."""
        if self.system:
            self.host.keep(index)
        else:
            self.keys = gather_tokens(self.keys, index.to(self.keys.device))
            self.values = gather_tokens(self.values, index.to(self.values.device))

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        out = self._attend(module, query, keys, values, attention_mask, base, **kwargs)
        if query.shape[2] == 1 and isinstance(self.next_layer, HostTierLayer):
            self.next_layer.launch_fetch()  # this layer's kernels are queued: it may sync now
        return out

    def held_bytes(self) -> tuple[int, int]:
        """(all, on the device) bytes of the stored K/V (valid tokens)."""
        if self.host is not None:
            return int(self.host.nbytes()), 0
        used = self.storage_stats().get("kv_bytes_used", 0)
        return used, used
