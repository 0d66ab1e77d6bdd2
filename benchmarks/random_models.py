"""Randomly initialised Llama-3-shaped models built in code, for speed only (outputs mean nothing):
for machines where no real >= 1B checkpoint can be loaded (a lent GPU has no network).

Shapes (transformers LlamaConfig fields) from the public Llama-3.2-1B and Llama-3.1-8B configs.
"""

from __future__ import annotations

import torch

SHAPES = {
    "random_llama_1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                            num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                            rope_theta=500000.0),
    "random_llama_8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                            num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                            rope_theta=500000.0),
    # a few-MB Llama (GQA 4/2, head_dim 64) for CPU tests and gpu_check.sh's dry run
    "random_llama_tiny": dict(vocab_size=512, hidden_size=256, intermediate_size=512,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              rope_theta=500000.0),
}


def random_llama(name: str, device: str, dtype: torch.dtype, max_positions: int):
    """(model, None): no tokenizer; prompts are random ids (`random_prompt`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from harness.core import hf_adapter

    config = LlamaConfig(**SHAPES[name], max_position_embeddings=max_positions)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    hf_adapter.set_attention(model, "sdpa")
    return model, None


def random_prompt(vocab: int, length: int, seed: int = 1) -> list[int]:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
