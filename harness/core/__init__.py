"""The engine: model loading, the cache adapter, prefill/decode, batches, accounting, timing.

Imports nothing of harness above it but `harness.store` (files) and `harness.CONF_DIR`."""
