"""Tiny randomly initialised models of the families users evaluate, built in code (no download).

Each keeps the family trait that can break a KV method, at a size where a forward takes
milliseconds on CPU:

* llama   GQA 4:2 (the harness's reference shape);
* qwen2   q/k/v biases, RoPE theta 1e6, 7 query heads per KV head (Qwen2-7B's 28:4);
* mistral a sliding window (24 tokens) shorter than the test sequences, so it really masks;
* gemma   head_dim (32) != hidden / heads (16), multi-query (1 KV head), scaled embeddings;
* phi3    one fused qkv_proj instead of q/k/v projections;
* qwen3   RMSNorm on each query and key head before RoPE (q_norm/k_norm), head_dim (32) !=
          hidden / heads (16): the query is no longer a linear function of the layer input.

Not in FAMILIES (only the tests of their one trait build them): `olmo2` norms each query and key
across all heads at once instead of per head; `granite` scales q.k by `attention_multiplier`
(0.05 here) instead of head_dim ** -0.5.

`deepseek_v2_config` is config-only: an MLA model (latent K/V) that methods must refuse before
any weights exist; so is `gemma3_text_config` (RoPE parameters per layer type).
"""

from __future__ import annotations

import torch

FAMILIES = ("llama", "qwen2", "mistral", "gemma", "phi3", "qwen3")
SLIDING_WINDOW_TOKENS = 24  # the tiny Mistral's window (shorter than the contract sequences)


def _common(hidden: int, heads: int, kv_heads: int, vocab: int, layers: int) -> dict:
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                max_position_embeddings=512, tie_word_embeddings=False)


def family_config(family: str, layers: int = 2, vocab: int = 256):
    """The transformers config of a tiny model of `family` (see FAMILIES)."""
    import transformers as tf

    if family == "llama":
        return tf.LlamaConfig(**_common(64, 4, 2, vocab, layers), rope_theta=10000.0)
    if family == "qwen2":
        return tf.Qwen2Config(**_common(224, 14, 2, vocab, layers), rope_theta=1e6,
                              use_sliding_window=False)
    if family == "mistral":
        return tf.MistralConfig(**_common(64, 4, 2, vocab, layers), head_dim=16,
                                sliding_window=SLIDING_WINDOW_TOKENS, rope_theta=10000.0)
    if family == "gemma":
        return tf.GemmaConfig(**_common(64, 4, 1, vocab, layers), head_dim=32, rope_theta=10000.0)
    if family == "phi3":
        return tf.Phi3Config(**_common(64, 4, 2, vocab, layers), rope_theta=10000.0,
                             pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "qwen3":
        return tf.Qwen3Config(**_common(64, 4, 2, vocab, layers), head_dim=32, rope_theta=1e6,
                              use_sliding_window=False)
    if family == "olmo2":
        return tf.Olmo2Config(**_common(64, 4, 2, vocab, layers), rope_theta=10000.0)
    if family == "granite":
        return tf.GraniteConfig(**_common(64, 4, 2, vocab, layers), rope_theta=10000.0,
                                attention_multiplier=0.05)
    raise ValueError(f"family={family!r}; allowed: {', '.join(FAMILIES)}, olmo2, granite")


def deepseek_v2_config(layers: int = 2, vocab: int = 256):
    """A tiny DeepSeek-V2 config: multi-head latent attention (MLA), its cache is not K/V heads."""
    from transformers import DeepseekV2Config

    return DeepseekV2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                            moe_intermediate_size=32, num_hidden_layers=layers,
                            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                            q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
                            v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                            first_k_dense_replace=layers, max_position_embeddings=512)


def gemma3_text_config(layers: int = 6, vocab: int = 256):
    """A tiny Gemma-3 text config: RoPE parameters per layer type (local theta on the sliding
    layers, global on every sixth), so no single set of frequencies rotates every layer."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=1,
                            head_dim=32, sliding_window=SLIDING_WINDOW_TOKENS,
                            max_position_embeddings=512)


def tiny_family_model(family: str, layers: int = 2, seed: int = 0, attn: str = "sdpa"):
    """A tiny randomly initialised causal LM of `family`, on our registered attention."""
    from transformers import AutoModelForCausalLM

    from harness.core import hf_adapter

    config = family_config(family, layers)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # transformers initialises biases to zero: make Qwen2's q/k/v ones count
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0.0, 0.5)
        for name, module in model.named_modules():  # and q/k norm gains (ones) per channel
            if name.endswith(("q_norm", "k_norm")):
                module.weight.normal_(1.0, 0.5)
    hf_adapter.set_attention(model, attn)
    return model


# --- a tiny model whose heads attend differently -------------------------------------------------
# Random tiny models attend almost alike across heads, so a method pairing a query head with the
# wrong KV head, or averaging the wrong group, keeps the same tokens there. `heads` is built so
# that it does not: per layer, each KV head's group is one kind of head, and the two query heads
# of a group look for different things.
HEADS_KV, HEADS_GROUP, HEADS_DIM, HEADS_HIDDEN = 4, 2, 16, 64
CLASSES = 8  # token id % CLASSES: the content each query head of a content head looks for
RARE_EVERY = 31  # ids divisible by it: a rare kind a sink-like head draws most of its mass to
_CONST, _CLASS0, _RARE = 0, 1, 1 + CLASSES  # embedding dimensions (the rest: small noise)
# RoPE dims: pair i = (i, i + 8) turns by theta_i per position; with theta 1e9, pairs 0 and 1
# turn 1 and 0.075 rad per position (a positional, local pattern), pairs 3 to 7 barely (< 0.03
# rad over the test sequences), so content matches there hold at any distance.
_LOCAL_DIMS, _CONTENT_DIMS = (0, 1), (3, 4, 5, 6)
HEAD_KINDS = ("local", "content", "rare", "content")


def head_kind(layer: int, kv_head: int) -> str:
    """The kind of KV head `kv_head` in `layer` (it rotates by layer, so layers differ too)."""
    return HEAD_KINDS[(kv_head + layer) % len(HEAD_KINDS)]


def content_classes(layer: int, kv_head: int) -> tuple[int, int]:
    """The token classes the two query heads of a content head look for."""
    first = (2 * kv_head + 3 * layer) % CLASSES
    return first, (first + 1) % CLASSES


def heads_config(layers: int = 3, vocab: int = 256):
    import transformers as tf

    return tf.LlamaConfig(vocab_size=vocab, hidden_size=HEADS_HIDDEN,
                          intermediate_size=2 * HEADS_HIDDEN, num_hidden_layers=layers,
                          num_attention_heads=HEADS_KV * HEADS_GROUP,
                          num_key_value_heads=HEADS_KV, head_dim=HEADS_DIM,
                          max_position_embeddings=512, rope_theta=1e9,
                          tie_word_embeddings=False)


def _head_weights(layer: int, kv_head: int, gen) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(the two query heads' (HEADS_DIM, hidden) weights, the KV head's key weight): each query
    row reads the constant dimension, each key row the feature its query heads look for."""
    q = [torch.randn(HEADS_DIM, HEADS_HIDDEN, generator=gen) * 0.02 for _ in range(HEADS_GROUP)]
    k = torch.randn(HEADS_DIM, HEADS_HIDDEN, generator=gen) * 0.02
    kind = head_kind(layer, kv_head)
    if kind == "local":  # q = k = constant: logits cos(d) and cos(0.075 d) of the distance d
        for r, dim in enumerate(_LOCAL_DIMS):
            q[r][dim, _CONST] = 1.5
            k[dim, _CONST] += 1.0
    else:
        features = ((_RARE, _CLASS0 + content_classes(layer, kv_head)[0]) if kind == "rare"
                    else tuple(_CLASS0 + c for c in content_classes(layer, kv_head)))
        for r, (dim, feature) in enumerate(zip(_CONTENT_DIMS[2 * (kind == "rare"):], features)):
            q[r][dim, _CONST] = 1.0
            k[dim, feature] = 2.0 if feature == _RARE else 1.0
    return q, k


def heads_model(layers: int = 3, seed: int = 0, attn: str = "sdpa"):
    """A tiny Llama (8 query heads, 4 KV heads, GQA 2) whose heads differ by construction: per
    layer, KV heads of a local kind (attending by distance), two content kinds (each query head
    attending the tokens of its own id class, a different class per query head, per KV head and
    per layer) and a sink-like kind (one query head drawn to rare ids); random weights
    elsewhere, small so that every layer's input stays close to the embedding."""
    from transformers import AutoModelForCausalLM

    from harness.core import hf_adapter

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(heads_config(layers), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight  # (V, hidden)
        emb.copy_(torch.randn(emb.shape, generator=gen) * 0.3)
        ids = torch.arange(emb.shape[0])
        emb[:, _CONST] = 4.0
        emb[ids, _CLASS0 + ids % CLASSES] = 4.0
        emb[:, _RARE] = torch.where(ids % RARE_EVERY == 0, 4.0, 0.0)
        model.lm_head.weight.mul_(20.0)  # logits that differ between tokens
        for i, layer in enumerate(model.model.layers):
            attn_module = layer.self_attn
            for h in range(HEADS_KV):
                q, k = _head_weights(i, h, gen)
                for r in range(HEADS_GROUP):
                    row = (h * HEADS_GROUP + r) * HEADS_DIM
                    attn_module.q_proj.weight[row:row + HEADS_DIM] = q[r]
                attn_module.k_proj.weight[h * HEADS_DIM:(h + 1) * HEADS_DIM] = k
    hf_adapter.set_attention(model, attn)
    return model


def permute_heads(model, kv_order: list[int], group_order: list[int] | None = None) -> None:
    """Reorders the attention heads in `model`'s weights, in place, without changing what it
    computes: new KV head i is old KV head kv_order[i] (its K/V rows and its query group move
    with it), and inside every group new query head r is old query head group_order[r]."""
    group_order = group_order or list(range(HEADS_GROUP))
    cfg = model.config
    g, d = cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim
    query_order = [kv_order[i // g] * g + group_order[i % g] for i in range(len(kv_order) * g)]

    def rows(order):
        return torch.cat([torch.arange(o * d, (o + 1) * d) for o in order])

    with torch.no_grad():
        for layer in model.model.layers:
            a = layer.self_attn
            a.q_proj.weight.copy_(a.q_proj.weight[rows(query_order)])
            for proj in (a.k_proj, a.v_proj):
                proj.weight.copy_(proj.weight[rows(kv_order)])
            a.o_proj.weight.copy_(a.o_proj.weight[:, rows(query_order)])


def query_order(kv_order: list[int], group_order: list[int] | None = None) -> list[int]:
    """The query-head order `permute_heads` gives: new query head i is old query_order[i]."""
    group_order = group_order or list(range(HEADS_GROUP))
    return [kv_order[i // HEADS_GROUP] * HEADS_GROUP + group_order[i % HEADS_GROUP]
            for i in range(len(kv_order) * HEADS_GROUP)]


def alter_kv_head(model, kv_head: int = 0, layer: int = 0) -> None:
    """Changes one KV head of one layer in place (seeded noise on its key weights, its value
    weights negated): what that layer computes in every other head stays the same."""
    d = model.config.head_dim
    attn = model.model.layers[layer].self_attn
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        rows = attn.k_proj.weight[kv_head * d:(kv_head + 1) * d]
        rows += torch.randn(rows.shape, generator=gen) * rows.abs().max()
        attn.v_proj.weight[kv_head * d:(kv_head + 1) * d] *= -1.0
