"""kv-harness: one engine, one method interface, every task.

The runner lives in `harness.run` (`python -m harness`), the prefill/decode loop in
`harness.engine`, and the only code touching transformers internals in `harness.hf_adapter`.
"""
