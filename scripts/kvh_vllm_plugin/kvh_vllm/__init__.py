"""kv-harness's vLLM plugin: Quest inside vLLM's CPU attention (docs/vllm.md, "A method inside
vLLM"). vLLM runs `register` (entry point group `vllm.general_plugins`) in the engine core and in
each worker before the model is built. It registers a backend only when the worker asked for a
method (`KVH_VLLM_METHOD`, set before the engine starts); otherwise it registers nothing, and
vLLM's attention is untouched. This package is the one piece of kv-harness that touches vLLM's
internals; it imports nothing of the harness."""

from __future__ import annotations

import os
import sys

from kvh_vllm.settings import QUEST_ENV, quest_settings, requested_method

BACKEND_PATH = "kvh_vllm.quest_backend.QuestCPUBackend"


def register() -> None:
    if requested_method() != "quest":
        return
    settings = quest_settings(os.environ.get(QUEST_ENV, ""))  # a bad knob fails before the model
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    print(f"kv-harness Quest: {BACKEND_PATH} registered for CPU_ATTN in process {os.getpid()} "
          f"({settings})", file=sys.stderr, flush=True)
