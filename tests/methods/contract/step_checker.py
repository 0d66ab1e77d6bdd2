"""The contract while a method compresses, checked at every forward and every layer of one
request (`check_compressing_contract`; the checks are listed in test_contract.py's docstring)."""

import torch

from harness.core import hf_adapter
from methods.eviction import EvictionLayer
from methods.layer import KVLayer
from methods.selection import SelectionLayer
from tests.conftest import make_engine
from tests.methods.contract import rules
from tests.methods.contract.direction import mirrored

SEQ_TOKENS, PREFILL_TOKENS, CHUNK_TOKENS = 64, 48, 16


def recomputed_keep(positions, scores, sinks, recent, seen, budgets):
    """Independently of the template's code: per KV head, the text positions a method's own
    `score()` and `protected(budget)` imply are kept, as (protected set, chosen set, candidates):
    every protected position held is kept; the rest of the head's budget (`budgets`: one per
    head, or one for all) goes to the highest scores among the unprotected (ties at the
    boundary: any of the tied tokens)."""
    out = []
    rows = positions.reshape(-1, positions.shape[-1]).tolist()
    budgets = budgets if isinstance(budgets, list) else [budgets] * len(rows)
    for pos_row, score_row, budget in zip(rows, scores.reshape(-1, scores.shape[-1]).tolist(),
                                          budgets):
        guard = {p for p in pos_row if p < sinks or p >= seen - recent}
        free = sorted(((s, p) for p, s in zip(pos_row, score_row) if p not in guard), reverse=True)
        out.append((guard, free, max(0, budget - len(guard))))
    return out


def held_rows(positions):
    """Per (batch row, KV head): the positions a layer holds (a ragged head's -1 padding out)."""
    return [[p for p in r if p >= 0] for r in positions.reshape(-1, positions.shape[-1]).tolist()]


class StepChecker:
    """Wraps one request's layers (instances only) and checks the contract at every forward and
    at every compression of a scored-eviction method (its kept set against its own rule)."""

    def __init__(self, method, info, layers):
        self.method, self.info, self.layers = method, info, layers
        self.forwards = 0
        self.compressed = False  # some layer held or attended less than the full cache
        self.choices = 0  # compressions where the scores chose among more tokens than slots
        self.prompt_budget: dict[int, int] = {}  # layer -> its budget at the prompt's end
        # layer -> (the rule's budget, tokens seen) when its prompt ended
        self.granted: dict[int, tuple[int, int]] = {}
        self.dense_rows: dict[int, bool] = {}  # layer -> its last forward attended a held prompt
        self.selected_mass = self.selected_share = 0.0  # see record_selection_mass
        self.selection_choices = 0  # selecting rows whose scores chose among candidates
        self.uneven = False  # some head-wise compression gave its heads different counts
        # layer -> (B, H_kv, max positions) fp64: the attention each text position received,
        # summed over query rows (group mean per KV head), for `accumulates_attention` layers
        self.accumulated: dict[int, torch.Tensor] = {}
        # layer -> (forward, its last query row (B, H_q, 1, D), the keys it attended, scaling):
        # what a later layer declaring this one as its scores' source is checked against
        self.attention_inputs: dict[int, tuple] = {}
        for layer in layers:
            layer.update = self._update(layer, layer.update)
            layer.attend = self._attend(layer, layer.attend)
            layer.after_forward = self._after_forward(layer, layer.after_forward)
            layer.on_prefill_end = self._on_prefill_end(layer, layer.on_prefill_end)
            if scored_eviction(layer):
                layer.compress_to = self._compress_to(layer, layer.compress_to)

    def _compress_to(self, layer, compress_to):
        def checked(budget):
            kept_before, seen = layer.kept_tokens(), layer.seen_tokens
            where = f"layer {layer.layer_idx} after {seen} tokens, budget {budget}"
            assert budget == self.rule(layer), (
                f"{where}: compressed to {budget}, the rule says {self.rule(layer)}")
            if kept_before <= budget:
                return compress_to(budget)
            positions, scores = layer.positions.clone(), layer.score().float().clone()
            tolerance = 0.0
            if layer.accumulates_attention:  # the declared rule's scores, not the layer's own
                scores = self.accumulated[layer.layer_idx].gather(2, positions.long())
                tolerance = 1e-4  # fp32 sums in the layer, fp64 here: near-ties either way
            sinks, recent = layer.protected(budget)
            compress_to(budget)
            kept = held_rows(layer.kept_positions())
            counts = [len(row) for row in kept]
            h_kv = layer.kept_positions().shape[1]
            if layer.method.allocates_per_head():  # head-wise: the split must hold the rule's total
                self.uneven |= len(set(counts)) > 1
                for b in range(len(counts) // h_kv):
                    assert sum(counts[b * h_kv:(b + 1) * h_kv]) == h_kv * budget, (
                        f"{where}: heads keep {counts[b * h_kv:(b + 1) * h_kv]}, the rule says "
                        f"{h_kv} x {budget}")
            else:
                assert counts == [budget] * len(counts), f"{where}: heads keep {counts}"
            expected = recomputed_keep(positions, scores, sinks, recent, seen, counts)
            for head, ((guard, free, slots), row) in enumerate(zip(expected, kept)):
                row = set(row)
                assert len(row) == counts[head], f"{where}, head {head}: repeated positions"
                budget = counts[head]
                self.check_knob_protections(layer, row, seen, budget, f"{where}, head {head}")
                assert guard <= row or len(guard) > budget, (
                    f"{where}, head {head}: declared protections (protected={sinks, recent}) "
                    f"evicted: {sorted(guard - row)}")
                chosen = [s for s, p in free if p in row]
                dropped = [s for s, p in free if p not in row]
                assert len(chosen) == min(slots, len(free)), f"{where}, head {head}"
                if chosen and dropped:
                    assert min(chosen) >= max(dropped) - tolerance, (
                        f"{where}, head {head}: kept a score {min(chosen):.4g} below an evicted "
                        f"{max(dropped):.4g} (the kept set is not the top of "
                        f"{'its accumulated attention' if tolerance else 'score()'})")
                    self.choices += 1
        return checked

    def rule(self, layer) -> int | None:
        """A budgeted layer's budget now, from its method's declared rule and the protocol's
        basis (tests/methods/contract/rules.py; never the layer's own `budget()`); under the final-length
        basis it may never change after the prompt: the basis does not."""
        rule = rules.rule_budget(layer, self.info.num_layers)
        if rule is not None and layer.protocol.budget_basis == "final":
            first = self.prompt_budget.setdefault(layer.layer_idx, rule)
            assert rule == first, (f"layer {layer.layer_idx}: the budget moved from {first} to "
                                   f"{rule} under the final-length basis")
        return rule

    def _on_prefill_end(self, layer, on_prefill_end):
        def checked():
            on_prefill_end()
            factors = rules.allocation_factors(self.layers)
            if factors is not None:  # a per-request split of the uniform budget: mean 1
                assert abs(sum(factors) / len(factors) - 1) < 1e-6, (
                    f"per-layer budget factors {factors} do not average 1")
            if rules.has_budget_rule(layer):
                self.check_layer_split(layer)
            if isinstance(layer, EvictionLayer) and rules.has_budget_rule(layer):
                rule = self.rule(layer)  # the allowance is the rule's, never self-granted
                self.granted[layer.layer_idx] = (rule, layer.seen_tokens)
                assert layer.allowed_tokens() == rule, (
                    f"layer {layer.layer_idx} at the prompt's end: allowed "
                    f"{layer.allowed_tokens()}, the rule says {rule}")
            self.check_budget_and_positions(layer)
        return checked

    def check_layer_split(self, layer):
        """A per-layer schedule (`layer_budget`) spends at most the uniform total over the
        layers, up to an integer schedule's rounding (below one token per pair of layers)."""
        method, n = layer.method, self.info.num_layers
        if getattr(layer, "squeeze", None) is not None:
            return  # its split is the factors' (their mean is checked)
        basis = KVLayer.basis_tokens(layer)
        split = [method.layer_budget(i, n, basis) for i in range(n)]
        uniform = method.total_tokens(basis)
        assert sum(split) <= n * uniform + n * (n - 1) // 2, (
            f"per-layer budgets {split} spend more than {n} x the uniform {uniform}")

    def rule_allowance(self, layer) -> int | None:
        """What a budgeted layer may hold (or attend) now under its method's rule: the rule's
        budget; a prompt compressor (compress_at="prefill_end"): the rule's budget at the prompt's
        end plus the tokens appended since; None while a prompt is held or attended in full."""
        if not rules.has_budget_rule(layer) or KVLayer.holding_prompt(layer):
            return None
        if self.dense_rows.get(layer.layer_idx):  # the last forward attended its prompt densely
            return None
        if isinstance(layer, EvictionLayer) and layer.compress_at == "prefill_end":
            granted = self.granted.get(layer.layer_idx)
            return None if granted is None else granted[0] + layer.seen_tokens - granted[1]
        return self.rule(layer)

    def _update(self, layer, update):
        def checked(keys, values, position_ids):
            q_len, seen = keys.shape[-2], layer.seen_tokens
            length, offset = layer.mask_sizes(q_len)  # what the mask will be built for
            out_k, out_v = update(keys, values, position_ids)
            b, h_kv, d = keys.shape[0], self.info.num_kv_heads, self.info.head_dim
            where = f"layer {layer.layer_idx} after {seen} tokens"
            if reads_own_cache(layer):  # update returned a part; attend reads the whole
                assert offset + length == seen + q_len, f"{where}: mask offset {offset} + {length}"
                return out_k, out_v
            assert out_k.shape[:2] == (b, h_kv) and out_k.shape[-1] == d, where
            assert out_v.shape == out_k.shape, where
            assert out_k.shape[-2] == length, (
                f"{where}: mask_sizes says {length} keys, update returned {out_k.shape[-2]}")
            assert offset + length == seen + q_len, f"{where}: mask offset {offset} + {length}"
            return out_k, out_v
        return checked

    def _attend(self, layer, attend):
        def checked(module, query, keys, values, attention_mask, base, **kwargs):
            if attention_mask is not None and not reads_own_cache(layer):  # eager: from mask_sizes
                assert tuple(attention_mask.shape[-2:]) == (query.shape[2], keys.shape[-2]), (
                    f"layer {layer.layer_idx}: mask {tuple(attention_mask.shape)} for "
                    f"{query.shape[2]} queries over {keys.shape[-2]} keys")
            self.dense_rows[layer.layer_idx] = KVLayer.holding_prompt(layer)
            scaling = kwargs.get("scaling")
            self.attention_inputs[layer.layer_idx] = (
                self.forwards, query[:, :, -1:], keys, module.scaling if scaling is None else scaling)
            if scored_eviction(layer) and layer.accumulates_attention:
                self.accumulate(layer, module, query, keys, attention_mask, kwargs)
            out = attend(module, query, keys, values, attention_mask, base, **kwargs)
            b, h_q, q_len, d = query.shape
            assert out[0].shape == (b, q_len, h_q, d), f"layer {layer.layer_idx}: output shape"
            self.record_selection_mass(layer, module, query, keys, kwargs)
            if isinstance(layer, SelectionLayer) and layer.selection is not None:
                self.check_selection(layer, module, query, keys, values, out[0], kwargs)
            elif isinstance(layer, SelectionLayer):  # nothing published: it must have attended all
                chose = layer.stats().get("selected_tokens", layer.seen_tokens)
                assert chose >= layer.seen_tokens, (
                    f"layer {layer.layer_idx} after {layer.seen_tokens} tokens: attended {chose} "
                    "tokens and published no `selection` to check them against its scores")
            return out
        return checked

    def accumulate(self, layer, module, query, keys, attention_mask, kwargs):
        """Adds this forward's attention to every held token's sum, computed here (fp64) from
        the query, the keys `update` returned and the mask: per KV head the mean over its query
        heads, summed over the query rows, at the tokens' text positions."""
        b, h_q, q, _ = query.shape
        h_kv, t = keys.shape[1], keys.shape[2]
        positions = layer.positions.long()  # (B, H_kv, T), aligned with keys
        assert positions.shape[-1] == t, f"layer {layer.layer_idx}: positions vs keys"
        scaling = kwargs.get("scaling")
        scaling = module.scaling if scaling is None else scaling
        k = keys.double().repeat_interleave(h_q // h_kv, dim=1)  # (B, H_q, T, D)
        logits = torch.einsum("bhqd,bhtd->bhqt", query.double(), k) * scaling
        if attention_mask is None:  # causal: the forward's own tokens are the last q keys
            rows = torch.arange(q, device=keys.device)[:, None] + (t - q)
            allowed = torch.arange(t, device=keys.device)[None, :] <= rows
            logits = logits.masked_fill(~allowed, float("-inf"))
        elif attention_mask.dtype == torch.bool:
            logits = logits.masked_fill(~attention_mask[..., -t:], float("-inf"))
        else:
            logits = logits + attention_mask[..., -t:].double()
        received = logits.softmax(-1).view(b, h_kv, h_q // h_kv, q, t).mean(2).sum(2)
        acc = self.accumulated.setdefault(
            layer.layer_idx, torch.zeros(b, h_kv, self.info.max_positions, dtype=torch.float64,
                                         device=keys.device))
        acc.scatter_add_(2, positions, received)

    def check_selection(self, layer, module, query, keys, values, out, kwargs):
        """A selecting layer's step against its own scores (`layer.selection`), at the last query
        row (every key is causal to it). Per selecting row (a query head, or a KV head for its
        group): the protected tokens are attended, the other attended tokens are whole units,
        `size` of them (or every candidate: a finite score), none scoring below a candidate left
        out (ties at the boundary: either). Per query head: the output is exact attention over its
        own row's set, so a KV head must have served the union of its query heads' sets (where
        `attend` got every token: a layer fetching from the host tier has its own output test)."""
        sel, unit = layer.selection, layer.unit_tokens
        b, h_q, _, d = query.shape
        h_kv, t = keys.shape[1], layer.seen_tokens
        scores, keep = sel.score_rows()[:, :, -1].float().cpu(), sel.keep[:, :, -1].cpu()
        h_sel = scores.shape[1]
        where = f"layer {layer.layer_idx} after {layer.seen_tokens} tokens"
        assert h_sel in (h_q, h_kv) and keep.shape == (b, h_sel, t), (
            f"{where}: {h_sel} selecting rows, neither the {h_q} query heads nor {h_kv} KV heads")
        self.check_source(layer, sel, scores, h_kv, where)
        first, last = sel.protected
        guard = set(range(first)) | set(range(t - last, t))
        for i, (row, held) in enumerate(zip(scores.reshape(-1, scores.shape[-1]).tolist(),
                                            keep.reshape(-1, t))):
            held = set(held.nonzero().flatten().tolist())
            assert guard <= held, f"{where}, row {i}: protected {sorted(guard - held)} not attended"
            units = {p // unit for p in held - guard}
            whole = {p for u in units for p in range(u * unit, min(t, (u + 1) * unit))}
            assert whole <= held, f"{where}, row {i}: units partly attended: {sorted(whole - held)}"
            candidates = {u for u, s in enumerate(row) if s != float("-inf")}
            size = sel.size if isinstance(sel.size, int) else int(sel.size.reshape(-1)[i])
            assert units <= candidates and len(units) == min(size, len(candidates)), (
                f"{where}, row {i}: chose {sorted(units)}, {size} of {sorted(candidates)}")
            chosen = [row[u] for u in units]
            dropped = [row[u] for u in candidates - units]
            if chosen and dropped:
                assert min(chosen) >= max(dropped), (
                    f"{where}, row {i}: attended a unit scoring {min(chosen):.4g} and left out one "
                    f"scoring {max(dropped):.4g} (the set is not the top of its scores)")
                self.selection_choices += 1
        if layer.scores_bound_logits and h_sel == h_q and keys.shape[2] == t:
            self.check_bounds(layer, query, keys, scores, unit)
        if sel.kv_rows is not None:  # rows fetched before `attend`: placed at their positions
            rows = sel.kv_rows.to(keys.device)[..., None].expand(-1, -1, -1, d)
            keys = keys.new_zeros(b, h_kv, t, d).scatter(2, rows, keys)
            values = values.new_zeros(b, h_kv, t, d).scatter(2, rows, values)
        elif t != keys.shape[2]:
            return  # attend got the device rows only (the rest fetched from the host): no outputs
        scaling = kwargs.get("scaling")
        scaling = module.scaling if scaling is None else scaling
        sets = keep.repeat_interleave(h_q // h_sel, dim=1).to(keys.device)  # (B, H_q, T)
        k = keys.double().repeat_interleave(h_q // h_kv, dim=1)  # (B, H_q, T, D)
        v = values.double().repeat_interleave(h_q // h_kv, dim=1)
        logits = torch.einsum("bhd,bhtd->bht", query[:, :, -1].double(), k) * scaling
        expected = torch.einsum("bht,bhtd->bhd", logits.masked_fill(~sets, float("-inf"))
                                .softmax(-1), v)
        got = out[:, -1].double()  # (B, H_q, D)
        worst = (got - expected).abs().amax(-1)  # (B, H_q)
        assert bool((worst <= 1e-4).all()), (
            f"{where}: query heads {worst.gt(1e-4).nonzero()[:, 1].tolist()} did not attend "
            f"exactly their own selected sets (max error {worst.max():.3g})")

    def source_inputs(self, layer, sel) -> tuple:
        """(last query row (B, H_q, 1, D), keys (B, H_kv, T, D), scaling) of the layer a
        selection declares as its scores' source (its own by default), at this forward."""
        source = layer.layer_idx if sel is None or sel.source_layer is None else sel.source_layer
        where = f"layer {layer.layer_idx} after {layer.seen_tokens} tokens"
        assert source <= layer.layer_idx, (
            f"{where}: scores declared from layer {source}, which has not run yet")
        recorded = self.attention_inputs.get(source)
        assert recorded is not None and recorded[0] == self.forwards, (
            f"{where}: scores declared from layer {source}, which did not attend in this forward")
        return recorded[1:]

    def check_source(self, layer, sel, scores, h_kv, where):
        """Scores declared as exact attention (`scores_are_attention`) equal the attention the
        contract computes from the declared source layer's query and keys (per query head, or
        the group's mean per KV head): a reuse layer reading another layer's scores, or scores
        pairing a query head with the wrong KV head, fail here."""
        query, keys, scaling = self.source_inputs(layer, sel)
        if not layer.scores_are_attention or keys.shape[2] != layer.seen_tokens:
            return
        b, h_q = query.shape[:2]
        k = keys.double().repeat_interleave(h_q // keys.shape[1], dim=1)  # (B, H_q, T, D)
        probs = (torch.einsum("bhd,bhtd->bht", query[:, :, -1].double(), k) * scaling).softmax(-1)
        if scores.shape[1] != h_q:
            probs = probs.view(b, h_kv, h_q // h_kv, -1).mean(2)  # (B, H_kv, T)
        worst = float((probs.cpu() - scores.double()).abs().max())
        source = layer.layer_idx if sel.source_layer is None else sel.source_layer
        assert worst <= 1e-4, (
            f"{where}: its scores are declared as layer {source}'s exact attention, and differ "
            f"from what the contract computes from that layer's query and keys by {worst:.3g}")

    def check_bounds(self, layer, query, keys, scores, unit):
        """Per query head, every scored unit's score is at least its largest q.k (unscaled)
        over the unit's tokens (`scores_bound_logits`)."""
        b, h_q, _, _ = query.shape
        k = keys.double().repeat_interleave(h_q // keys.shape[1], dim=1)  # (B, H_q, T, D)
        logits = torch.einsum("bhd,bhtd->bht", query[:, :, -1].double(), k)
        t = logits.shape[-1]
        padded = logits.new_full((b, h_q, -(-t // unit) * unit), float("-inf"))
        padded[..., :t] = logits
        largest = padded.view(b, h_q, -1, unit).amax(-1)  # (B, H_q, U)
        scored = torch.isfinite(scores.double())
        short = scored & (scores.double() < largest.cpu() - 1e-4 * (1 + largest.cpu().abs()))
        assert not bool(short.any()), (
            f"layer {layer.layer_idx} after {layer.seen_tokens} tokens: units "
            f"{short.nonzero().tolist()[:4]} score below their tokens' q.k (the scores must "
            "bound it from above)")

    def record_selection_mass(self, layer, module, query, keys, kwargs):
        """A selecting layer's decode step over every token it holds: the exact attention mass
        (softmax of this query over all keys; per KV head the group's mean when it selects per
        KV head) on the positions it attended (`kept_positions`), against their share of the
        tokens. Summed over the run, a selection by any proxy of attention beats its share; a
        selection pointing the wrong way (the lowest scores) falls below it."""
        if (query.shape[2] != 1 or not torch.is_tensor(keys) or KVLayer.holding_prompt(layer)
                or keys.shape[2] != layer.seen_tokens or "selected_tokens" not in layer.stats()):
            return
        # a selection from another layer's query carries that layer's attention, not this one's
        query, keys, scaling = self.source_inputs(layer, getattr(layer, "selection", None))
        if keys.shape[2] != layer.seen_tokens:
            return
        b, h_q, _, _ = query.shape
        h_kv, t = keys.shape[1], keys.shape[2]
        positions = layer.kept_positions()  # (B, H_sel, n)
        if positions.shape[-1] >= t:
            return  # attended everything
        expanded = keys.float().repeat_interleave(h_q // h_kv, dim=1)  # (B, H_q, T, D)
        probs = (torch.einsum("bhd,bhtd->bht", query[:, :, 0].float(), expanded)
                 * scaling).softmax(-1)  # (B, H_q, T)
        if positions.shape[1] != h_q:
            probs = probs.view(b, h_kv, h_q // h_kv, t).mean(2)  # (B, H_kv, T)
        for prob_row, row in zip(probs.reshape(-1, t), positions.reshape(-1, positions.shape[-1])):
            held = torch.unique(row[row >= 0])
            self.selected_mass += float(prob_row[held].sum())
            self.selected_share += held.numel() / t

    def _after_forward(self, layer, after_forward):
        def checked():
            after_forward()
            self.check_budget_and_positions(layer)
            if layer.layer_idx == 0:
                self.forwards += 1
        return checked

    def check_budget_and_positions(self, layer):
        seen, stats, budget = layer.seen_tokens, layer.stats(), layer.allowed_tokens()
        used = stats.get("selected_tokens", stats["kv_tokens"])
        where = f"layer {layer.layer_idx} after {seen} tokens"
        if budget is not None:
            assert used <= budget, f"{where}: uses {used} tokens, budget {budget}"
        rule = self.rule_allowance(layer)
        if rule is not None:
            assert used <= rule, f"{where}: uses {used} tokens, the method's rule allows {rule}"
        full_bytes = 2 * seen * self.info.num_kv_heads * self.info.head_dim * 4  # fp32 K and V
        self.compressed |= used < seen or stats["kv_bytes"] < full_bytes
        positions = layer.kept_positions()
        assert not positions.is_floating_point(), where
        lengths = layer.kept_lengths() if hasattr(layer, "kept_lengths") else None
        if lengths is not None:  # ragged heads: padded with -1 past each head's own length
            self.check_ragged(layer, positions, lengths, stats)
        held = held_rows(positions)
        assert all(0 <= p < seen for r in held for p in r), f"{where}: positions out of range"
        assert all(len(set(r)) == len(r) for r in held), f"{where}: repeated positions"
        if "selected_tokens" not in stats and lengths is None:
            assert positions.shape[-1] == stats["kv_tokens"], where
        rows = positions.reshape(-1, positions.shape[-1]).cpu()
        self.check_declared_keeps(layer, rows, budget, stats["kv_tokens"])

    def check_ragged(self, layer, positions, lengths, stats):
        """Ragged heads: exactly `lengths` held positions per head, the padding -1; the token
        figure is the mean over heads (rounded up) and the bytes count only what heads hold
        (with the slots that stand for no position, `virtual_slots()`: RazorAttention's
        compensation token); a layer with a per-head rule (`head_allowed_tokens()`) holds at
        most that in every head."""
        where = f"layer {layer.layer_idx} after {layer.seen_tokens} tokens"
        counts = (positions >= 0).sum(-1)
        assert torch.equal(counts.cpu(), lengths.cpu()), f"{where}: padding is not -1"
        slots = torch.arange(positions.shape[-1], device=positions.device)
        assert bool(((slots < lengths[..., None]) == (positions >= 0)).all()), where
        held = lengths + (layer.virtual_slots() if hasattr(layer, "virtual_slots") else 0)
        assert stats["kv_tokens"] == -(-int(held.sum()) // held.numel()), (
            f"{where}: kv_tokens {stats['kv_tokens']} for heads holding {held.tolist()}")
        token_bytes = 2 * self.info.head_dim * layer.keys.element_size()  # K and V, one head
        assert stats["kv_bytes"] == int(held.sum()) * token_bytes, (
            f"{where}: kv_bytes {stats['kv_bytes']} for heads holding {held.tolist()}")
        allowed = layer.head_allowed_tokens() if hasattr(layer, "head_allowed_tokens") else None
        if allowed is not None:
            assert bool((held <= allowed).all()), (
                f"{where}: heads hold {held.tolist()}, the rule allows {allowed.tolist()}")
        self.check_standing_slots(layer, lengths)

    def check_standing_slots(self, layer, lengths):
        """A slot standing for the tokens its head evicted (no text position: `virtual_slots()`)
        weighs in attention as all of them: its logit bias (`slot_bias()`) is the log of how
        many they are, counted here from what the head has seen and holds; no other slot has
        one (RazorAttention's compensation token, eq. 5: +log|D|)."""
        virtual = layer.virtual_slots() if hasattr(layer, "virtual_slots") else None
        if virtual is None or not bool(virtual.any()):
            return
        where = f"layer {layer.layer_idx} after {layer.seen_tokens} tokens"
        bias = layer.slot_bias()
        assert bias is not None, f"{where}: a slot stands for evicted tokens, with no bias"
        evicted = (layer.seen_tokens - lengths).double()  # (B, H_kv) per head
        expected = torch.where(virtual.bool(), evicted.clamp(min=1).log(), 0.0)
        assert torch.allclose(bias.double().sum(-1).cpu(), expected.cpu(), atol=1e-5), (
            f"{where}: standing slots' bias {bias.sum(-1).tolist()}, the log of the tokens they "
            f"stand for {expected.tolist()}")
        assert bool(((bias != 0).sum(-1) <= virtual).all()), f"{where}: bias on a text slot"

    def check_declared_keeps(self, layer, rows, budget, kept):
        """Every protection the method's knobs declare (tests/methods/contract/rules.py) is held in every
        row (attended, for a selecting layer) whenever the layer holds or attends fewer tokens
        than it has seen; a row's budget is the tokens it holds."""
        seen = layer.seen_tokens
        used = layer.stats().get("selected_tokens", kept)
        if used >= seen or (budget is None and rules.has_budget_rule(layer)):
            return
        where = f"layer {layer.layer_idx} after {seen} tokens"
        for head, row in enumerate(held_rows(rows)):
            self.check_knob_protections(layer, set(row), seen, len(row), f"{where}, row {head}")

    def check_knob_protections(self, layer, row: set, seen: int, cap: int, where: str):
        first, last = rules.declared_protections(rules.method_of(layer, self.method), cap)
        first, last = min(first, seen), min(last, seen)
        missing = sorted((set(range(first)) | set(range(seen - last, seen))) - row)
        assert not missing, (f"{where}: positions {missing} evicted, though the method's knobs "
                             f"protect the first {first} and the last {last} "
                             "(tests/methods/contract/rules.py)")


def reads_own_cache(layer) -> bool:
    """A quantizing layer whose decode attention reads its packed cache itself (KIVI, KVQuant,
    TailorKV's quantized layers: `step_cache`, set by update, consumed by attend): update returns
    only the tokens kept exact, so the K/V it returns are not what the mask describes (their
    outputs equal dequantize-then-attend: tests/methods/test_kivi.py, test_kvquant.py)."""
    return getattr(layer, "step_cache", None) is not None


def scored_eviction(layer) -> bool:
    """A layer on the scored-eviction template that keeps the top of its own scores, whatever
    code of its own does it (`selects_top_scores`; KVMerger merges instead, by its own test)."""
    return isinstance(layer, EvictionLayer) and layer.selects_top_scores


def check_compressing_contract(model, method, trained=False, attn="eager", adverse=False):
    """The contract while `method` compresses SEQ_TOKENS random tokens (`attn` attention, a
    chunked prompt, then decode steps); raises AssertionError / BudgetViolation on a breach.
    `trained`: a trained model, whose heads differ (a random tiny model's may all look alike,
    so a per-head split may rightly come out even there). Eager attention passes every layer
    its mask (checked against `mask_sizes`); sdpa passes none to a plain decode row, the case a
    fused decode kernel serves (H2O's). `adverse`: every scored-eviction layer's score negated
    (direction.mirrored): the tokens its knobs protect are then the first its scores would drop,
    so a protection one token short cannot hide behind scores that keep that token anyway."""
    name, settings = method.name, method.hyperparameters()
    info = hf_adapter.model_info(model.config)
    ids = torch.randint(3, 250, (1, SEQ_TOKENS), generator=torch.Generator().manual_seed(7))
    hf_adapter.set_attention(model, attn)
    try:
        engine = make_engine(model, method, chunk=CHUNK_TOKENS)
        with engine.request() as req:
            if adverse:
                mirrored(req.cache.kv_layers)
                for layer in req.cache.kv_layers:  # its rule's own scores no longer apply
                    layer.accumulates_attention = False
            checker = StepChecker(method, info, req.cache.kv_layers)
            logits = req.prefill(ids[:, :PREFILL_TOKENS])
            for i in range(PREFILL_TOKENS, SEQ_TOKENS):
                logits = req.step(ids[:, i])
    finally:
        hf_adapter.set_attention(model, "sdpa")
    assert torch.isfinite(logits).all()
    assert checker.forwards == PREFILL_TOKENS // CHUNK_TOKENS + SEQ_TOKENS - PREFILL_TOKENS
    # the engine calls these hooks only for a method declaring the flag (before layers exist)
    for flag, hook in (("observes_attention_block", "observe_attention_block"),
                       ("needs_token_ids", "observe_token_ids")):
        own = any(getattr(type(kv), hook) is not getattr(KVLayer, hook)
                  for kv in req.cache.kv_layers)
        assert own == getattr(method.capabilities, flag), f"{name}: {hook} vs {flag}"
    assert checker.compressed == method.capabilities.compresses, (
        f"{name} {settings}: held or attended less than the full cache: {checker.compressed}")
    if trained and any(scored_eviction(layer) and layer.method.allocates_per_head()
                       for layer in req.cache.kv_layers):
        assert checker.uneven, (f"{name} {settings}: declares its own per-head split "
                                "(head_budgets) but every compression kept equal counts per head")
    if checker.selected_share:
        # measured (seed 7): oracle_topk 1.02-4.7, Quest 1.007-2.5, InfiniGen 1.009-1.9 over the
        # families (the random tiny models' attention is nearly flat; stories260K's is not)
        assert checker.selected_mass > checker.selected_share, (
            f"{name} {settings}: the tokens it attended carry {checker.selected_mass:.3f} of the "
            f"exact attention summed over decode steps and heads, below their share "
            f"{checker.selected_share:.3f}: the selection points the wrong way")
    if any(isinstance(layer, SelectionLayer) for layer in req.cache.kv_layers):
        assert checker.selection_choices > 0, (
            f"{name} {settings}: its scores never chose (every candidate attended): the "
            "compressing case must leave candidates out (compressing_hyperparameters)")
    if any(scored_eviction(layer) for layer in req.cache.kv_layers):
        assert checker.choices > 0, (
            f"{name} {settings}: its scores never chose a token (every slot protected): the "
            "compressing case must leave slots to the scores (compressing_hyperparameters)")
