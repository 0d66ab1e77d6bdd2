"""How every method of a comparison is run (`Protocol`, from runner.*): the prefill mode, the
budget basis and the decode-time recompression, the same for all methods, with what each means."""

from __future__ import annotations

from dataclasses import dataclass

PREFILL_MODES = ("dense", "chunked", "sparse")
BUDGET_BASES = ("final", "seen")
# When a method may compress a prompt, per prefill mode (Protocol.prefill; metrics.json records it).
COMPRESSION_TIMING = {
    "dense": "prompt attended in full and compressed once, when it ends; decode steps per method",
    "chunked": "compressed after every prefill chunk (memory-bounded; chunk size in the protocol)",
    "sparse": "every prompt row attends under the budget, as a decode step would",
}


def compression_timing(protocol: "Protocol") -> str:
    """When a method may compress under `protocol`, as metrics.json records it."""
    timing = COMPRESSION_TIMING[protocol.prefill]
    if protocol.decode_interval_tokens is not None:
        timing += (f"; then every {protocol.decode_interval_tokens} tokens after the prompt, "
                   "brought back to the budget by the method's own scorer")
    return timing


@dataclass(frozen=True)
class Protocol:
    """How every method of a comparison is run (runner.*), the same for all of them.

    dense_layers: layers left uncompressed (the full cache, attended in full) for every method;
        the effective set also holds a method's own structural dense layers (`own_dense_layers`).
    prefill: when a method may compress a prompt, whatever `runner.prefill_chunk_tokens` is:
        "dense" (default) = the whole prompt is attended in full and every method compresses it
        once, when it ends (the official TOVA, SnapKV, DuoAttention and kvpress protocol); decode
        steps then act as the method says. "chunked" = memory-bounded prefill: a method that
        compresses during a prompt does so after every chunk of `prefill_chunk_tokens` (the
        chunk size is then part of the protocol). "sparse" = every prompt row attends under the
        method's budget, exactly as a decode step would (the engine feeds the prompt one token
        at a time unless the method declares `Capabilities.sparse_prefill_chunked`).
    budget_basis: what a ratio budget (`budget_ratio`) is a fraction of: "final" (default) = the
        sequence's final length, fixed from the start (a prompt's length for prompt tasks, the
        whole scored text for a stream): what papers mean by "a 20 % KV budget" (InfiniGen's
        mask simulation, Quest, TailorKV, kvpress); nothing is evicted or skipped until that many
        tokens are held. "seen" = a fraction of the tokens seen so far, from the first token.
        `budget_tokens` is absolute under both.
    decode_interval_tokens: None (default) = a once-per-prompt compressor keeps every generated
        token; N = every N tokens fed after the prompt's end, its cache is brought back to its
        budget by its own scorer (kvpress's DecodingPress), so it never holds more than the
        budget plus N (methods declaring `Capabilities.recompresses_during_decode`).
    """

    dense_layers: tuple[int, ...] = ()
    prefill: str = "dense"
    budget_basis: str = "final"
    decode_interval_tokens: int | None = None
