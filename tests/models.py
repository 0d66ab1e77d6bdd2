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

    from harness import hf_adapter

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
