"""When a prompt starts and ends, for every method alike (methods.protocol.Protocol).

The engine (`Request.prefill`) and the batch (`BatchRequest.prefill`) both feed prompts through
these two calls, so "dense prefill" means one thing everywhere: the layers hold the prompt in full
while it is fed (`KVLayer.holding_prompt`) and compress it once when it ends, whatever
`runner.prefill_chunk_tokens` is.
"""

from __future__ import annotations

from harness.core.forward import check_budget


def open_prompt(layers, final_tokens: int | None) -> None:
    """A prompt is about to be fed to one sequence's `layers`: under `runner.prefill=dense` they
    hold it in full until `close_prompt`. `final_tokens` (None: unchanged) becomes the sequence's
    budget basis (Protocol.budget_basis="final")."""
    for kv in layers:
        kv.prompt_open = True
        if final_tokens is not None:
            kv.final_tokens = final_tokens


def score_prompt(layers) -> None:
    """The prompt fed since `open_prompt` is complete: every layer's prompt-end work that no
    prompt-end knob changes (`KVLayer.score_prompt`), once; `close_prompt` does it first."""
    for kv in layers:
        kv.score_prompt()


def close_prompt(engine, layers) -> None:
    """The prompt fed since `open_prompt` is over: every layer scores it (`score_prompt`, unless
    done already) and compresses it now (`on_prefill_end`). The budget is checked right after
    the compression, so a method that keeps more than its rule at the prompt's end fails there.

    Tokens fed with `prefill(..., prompt_ends=False)` (a query-agnostic question after its
    compressed context) open no prompt: they are decode-time input, each forward compressed as a
    decode step would be."""
    score_prompt(layers)
    for kv in layers:
        kv.prompt_open = False
        kv.on_prefill_end()
    check_budget(engine, layers)
