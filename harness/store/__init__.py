"""Files a run reads and writes: user inputs read with caps, the metrics.json schema, run
folders written atomically, the folders make targets empty, the loggers (W&B mirror).

The bottom of harness: imports nothing of harness but `harness.CONF_DIR`."""
