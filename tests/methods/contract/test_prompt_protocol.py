"""The default protocol (`runner.prefill=dense`): the whole prompt is attended in full and every
method compresses it once, when it ends, whatever `runner.prefill_chunk_tokens` is (a memory
knob, never a protocol one). Checked for every registered method: greedy continuations, logits
and the KV figures the run reports are the same for chunks of 16, 1, 40 and >= the prompt (a one-token chunk is still a
prompt row, never a decode step).

Tolerance. Chunked and whole-prompt forwards run different kernels, so the model's own K/V
differ by float noise (fp32: ~1e-6, inside the 1e-4 the logits are held to). A method that
rounds (a `*_bits` knob: a quantizer) maps values to codes, and noise moves a value sitting at a
rounding boundary to the neighbouring code: a one-code change moves the logits by ~1e-3 (seen:
7.6e-4 on an AVX-512 CPU), so in fp32 the test would pass or fail by where one CPU's noise
falls, not by the method. Those methods are checked in float64: the forward's noise (~1e-15)
cannot reach the fp32 quantizer (a value changes its fp32 rounding with probability ~1e-8, and
a code only if that also sits on a boundary), so the codes are the same whatever the chunking
unless the method itself makes them depend on it, and the logits are held to 1e-9.
"""

import copy

import pytest
import torch

from methods import available_methods, build_method, method_class
from tests.conftest import make_engine
from tests.methods.contract.common import get_model, skip_if_refused

PROMPT_TOKENS, DECODE_STEPS = 96, 6
CHUNKS = (16, 1, 40, 128)
FP32_TOLERANCE, FP64_TOLERANCE = 1e-4, 1e-9


def rounds(name: str) -> bool:
    """A quantizing method: one with a bit-width knob."""
    return any(key.endswith("_bits") for key in method_class(name).hyperparameter_names())


def continue_prompt(model, name, chunk):
    method = build_method(name, **method_class(name).compressing_hyperparameters(PROMPT_TOKENS))
    engine = make_engine(model, method, chunk=chunk)
    prompt = torch.randint(3, 250, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(11))
    with engine.request() as req:
        logits = [req.prefill(prompt.tolist())[0, -1]]
        for _ in range(DECODE_STEPS):
            logits.append(req.step(int(logits[-1].argmax()))[0, -1])
    sample = engine.ledger.samples[-1]
    figures = {k: sample[k] for k in ("tokens_per_layer", "bytes_per_layer", "budget_per_layer",
                                      "selected_per_layer")}
    return torch.stack(logits), figures, engine.attended.summary()


@pytest.mark.parametrize("name", available_methods())
def test_dense_prefill_compresses_once_whatever_the_chunk_size(name, request, tmp_path,
                                                               monkeypatch):
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = get_model("llama", request, layers=3)
    skip_if_refused(build_method(name, **method_class(name).compressing_hyperparameters(
        PROMPT_TOKENS)), model)
    tolerance = FP32_TOLERANCE
    if rounds(name):
        model, tolerance = copy.deepcopy(model).double(), FP64_TOLERANCE
    runs = [continue_prompt(model, name, chunk) for chunk in CHUNKS]
    ref_logits, ref_figures, ref_attended = runs[0]
    for chunk, (logits, figures, attended) in zip(CHUNKS[1:], runs[1:]):
        where = f"{name}: prefill_chunk_tokens={chunk} vs {CHUNKS[0]}"
        assert logits.argmax(-1).tolist() == ref_logits.argmax(-1).tolist(), where
        assert (logits - ref_logits).abs().max().item() <= tolerance, where
        assert figures == ref_figures, where
        assert attended == ref_attended, where
