"""The run's configuration: key and choice checks, the typed runner settings, the generated
configuration reference. Imports harness.core and harness.store only."""
