"""Prompts and knobs for the generation tests: a story prompt, random token prompts of given
lengths, and the hyperparameters under which a method compresses a prompt."""

import torch

from methods import method_class

PROMPT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the "
          "park with her friends. One day, she saw a big red ball under a tree. She wanted to play "
          "with it, so she ran to the tree. Her mom said")


def prompts_of(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in lengths]


# Calibration on a few short texts instead of 16 x 2048 tokens: seconds instead of minutes.
QUICK = {"kvquant": {"calibration_tokens": 256, "calibration_samples": 2}}


def knobs_for(name: str, prompt_tokens: int) -> dict:
    """Hyperparameters under which the method really compresses this prompt (its contract's)."""
    return {**method_class(name).compressing_hyperparameters(prompt_tokens), **QUICK.get(name, {})}
