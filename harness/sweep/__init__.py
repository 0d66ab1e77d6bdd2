"""Sweeps: many settings of one task. `multirun` (run identity, resume, Hydra's per-member
status), `run` (the launcher's entry: one shard process), `execute` (prefill once, compress
many: where one (setting, request) runs), `decode` (settings decoded together), `replay` (one
recorded forward replayed into each group's layers), `records` (what a shared prefill cost),
`shards`, `rounds` (sequential rounds), `cluster` (SLURM)."""
