"""The SLURM launcher's own logic, without a cluster: the refusal line and how a job that left
SLURM's queue without a result is told apart from one still running (tests/slurm runs it for real)."""

import json

from harness.sweep import cluster
from hydra_plugins.kvh_slurm import slurm_launcher

SBATCH_ERROR = ("Command '['sbatch', '/x/.submission_file_1.sh']' returned non-zero exit status 1.\n"
                "Error stream:\nsbatch: error: Memory specification can not be satisfied\n"
                "sbatch: error: Batch job submission failed: Requested node configuration is not "
                "available\n")


def test_refusal_is_one_line_with_what_was_asked():
    line = cluster.refusal_line({"partition": None, "gpus_per_node": 0, "mem_gb": 512,
                                 "submitit_folder": "x"}, SBATCH_ERROR)
    assert "\n" not in line
    assert "Memory specification can not be satisfied; Batch job submission failed" in line
    assert "partition=(cluster default), gpus_per_node=0, mem_gb=512" in line
    assert "submitit_folder" not in line


def test_queue_states_tell_running_from_ended():
    queue = {"7_0": "RUNNING", "7_1": "CANCELLED", "7_3": "PENDING"}
    assert cluster.ended_in_queue(queue, "7_0") is None
    assert cluster.ended_in_queue(queue, "7_3") is None
    assert cluster.ended_in_queue(queue, "7_1") == "CANCELLED"
    # An array task cancelled while pending vanishes from the queue and from sacct.
    assert "no longer in the queue" in cluster.ended_in_queue(queue, "7_2")
    assert cluster.ended_in_queue(None, "7_2") is None  # squeue failed: keep waiting


class FakeJob:
    def __init__(self, job_id, done_after_polls):
        self.job_id, self.left = job_id, done_after_polls

    def done(self):
        self.left -= 1
        return self.left < 0


def test_wait_reports_a_vanished_job_after_the_grace_period(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(slurm_launcher.time, "time", lambda: clock[0])
    monkeypatch.setattr(slurm_launcher.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    # 7_0 runs then writes its result; 7_2 was cancelled while pending and never appears.
    monkeypatch.setattr(slurm_launcher, "queue_states", lambda ids: {"7_0": "RUNNING"})
    ended = slurm_launcher.wait_for_jobs([FakeJob("7_0", 5), FakeJob("7_2", 10**9)], poll_s=2)
    assert list(ended) == ["7_2"] and "no longer in the queue" in ended["7_2"]
    assert clock[0] > cluster.ENDED_GRACE_S


def test_unfinished_member_status_does_not_overwrite_its_own(tmp_path):
    cluster.record_unfinished(tmp_path, 3, ["method=h2o"], "SLURM job 7_3 ended (CANCELLED)")
    status = json.loads((tmp_path / "status" / "0003.json").read_text())
    assert status["status"] == "failed" and "CANCELLED" in status["detail"]
    (tmp_path / "status" / "0004.json").write_text(json.dumps({"status": "ok"}))
    cluster.record_unfinished(tmp_path, 4, [], "late")
    assert json.loads((tmp_path / "status" / "0004.json").read_text())["status"] == "ok"
