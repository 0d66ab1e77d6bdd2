"""`hydra/launcher=kvh_sweep` (the default, conf/hydra/launcher/kvh_sweep.yaml): a local multirun
whose members sharing model and task run through the sweep engine (harness.sweep.execute).
Hydra only instantiates launchers defined under the `hydra_plugins` package, hence this module."""
