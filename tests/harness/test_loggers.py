"""The W&B mirror (logger=wandb, harness.report.loggers): its options checked before the weights load,
and a failing mirror costing the mirror, not the result."""

import errno
import json
import logging

import pytest

from harness.run import run
from tests.helpers.runs import ST, cfg_for, refused


@pytest.mark.usefixtures("shared_folder")
@pytest.mark.parametrize("overrides, env, expect", [
    (["logger.mode=foo"], {}, "logger.mode='foo'; allowed: online, offline, disabled"),
    (["logger.entity=5"], {}, "logger.entity=5 must be a non-empty string"),
    (["logger.group=[a,b]"], {}, "logger.group=['a', 'b'] must be a non-empty string"),
    (["logger.project=team/proj"], {}, "logger.project='team/proj': a W&B project name"),
    ([], {"WANDB_MODE": "bogus"}, "WANDB_MODE='bogus'"),
    (["logger.mode=online"], {"WANDB_MODE": None}, "no W&B credentials are set up"),
])
def test_wandb_options_are_checked_before_the_weights(overrides, env, expect, tmp_path,
                                                      monkeypatch, no_weight_loading):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    for key, value in env.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    assert expect in refused(tmp_path, *ST, "logger=wandb", *overrides)


class _BrokenStream:
    """A log file on a full disk."""

    def write(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self):
        raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.usefixtures("shared_folder")
def test_a_failing_mirror_costs_the_mirror_not_the_result(tmp_path, monkeypatch, capfd):
    """W&B's own log handler on a full disk printed a traceback per record (30,000 lines) and
    the run's result was lost with the mirror."""
    import wandb

    def init(**kwargs):
        log = logging.getLogger("wandb.kvh-test")
        log.addHandler(logging.StreamHandler(_BrokenStream()))
        for i in range(50):
            log.warning("record %d", i)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(wandb, "init", init)
    out = run(cfg_for(*ST, "logger=wandb", "logger.mode=offline",
                      f"runner.results_root={tmp_path}"))
    metrics = json.loads((out / "metrics.json").read_text())
    assert "logger" not in metrics and not (out / "wandb").exists()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Logging error" not in err
    assert "warning: logger=wandb: the mirror failed (OSError" in err
