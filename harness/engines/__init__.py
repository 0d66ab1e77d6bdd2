"""Other serving engines beside ours, run on the same samples (`vllm_engine`: the only module
that touches vLLM)."""
