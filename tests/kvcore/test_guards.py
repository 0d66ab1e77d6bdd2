"""kvcore.guards: every KV allocation estimated against the memory available first (a paged
block, a batch that outgrows memory: one line), and a stop requested by a signal taking effect
at the next storage write."""

import pytest
import torch

from harness.run import run
from tests.helpers.runs import ST, cfg_for, refused


@pytest.mark.usefixtures("shared_folder")
def test_a_block_beyond_the_models_positions_is_refused(tmp_path, no_weight_loading):
    message = refused(tmp_path, *ST, "runner.kv_layout=paged", "runner.kv_block_tokens=100000000")
    assert "larger than the model's max positions (512)" in message


@pytest.mark.usefixtures("shared_folder")
def test_a_first_block_that_cannot_fit_is_refused_with_the_estimate(tmp_path, monkeypatch,
                                                                    no_weight_loading):
    from kvcore import guards

    monkeypatch.setattr(guards, "available_bytes", lambda device: 1000)
    message = refused(tmp_path, *ST, "runner.kv_layout=paged", "runner.kv_block_tokens=512")
    assert "one block per layer and sequence needs" in message and "is available" in message


def test_memory_guard_estimates_every_kv_allocation_first(monkeypatch):
    from kvcore import guards
    from kvcore.offload import Tier, TransferLedger
    from kvcore.paged import BlockPool
    from kvcore.storage import ContiguousRows, TokenMajorRows

    monkeypatch.setattr(guards, "GUARD_MIN_BYTES", 0)
    monkeypatch.setattr(guards, "available_bytes", lambda device: 100_000)
    small, big = torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 2000, 8)  # (B, H, T, D)
    ContiguousRows().append(small)  # a 256-row buffer: 16 KiB fit
    for make in (ContiguousRows, TokenMajorRows):  # 3072 rows: 192 KiB do not
        with pytest.raises(guards.MemoryLimit, match=r"would need 192.0 KiB but 97.7 KiB of "
                                                     "cpu memory is available"):
            make().append(big)
    pool = BlockPool(block_tokens=4)
    pool.allocate(10, small)
    with pytest.raises(guards.MemoryLimit, match="paged KV pool growing to 1010 blocks"):
        pool.allocate(1000, small)
    tier = Tier(torch.device("cpu"), TransferLedger(num_layers=1), offload=True)
    with pytest.raises(guards.MemoryLimit, match="host-tier KV buffer"):
        tier.host_tensor((1, 2, 2000, 8), torch.float32)


@pytest.mark.usefixtures("shared_folder")
def test_a_batch_that_outgrows_memory_stops_in_one_line(tmp_path, monkeypatch):
    """Each sequence's buffer (768 rows: 96 KiB per layer) is checked against the memory
    available when it is allocated (live: earlier buffers count), here a fixed 48 KiB."""
    from kvcore import guards

    monkeypatch.setattr(guards, "GUARD_MIN_BYTES", 0)
    monkeypatch.setattr(guards, "available_bytes", lambda device: 50_000)
    # the task's own estimate before the run would refuse it first: the guard at allocation
    # time is what is checked here
    monkeypatch.setattr("tasks.ruler.size_reason", lambda *a, **k: None)
    with pytest.raises(guards.MemoryLimit, match="is available"):
        run(cfg_for("model=stories260k", "task=ruler", "task.lengths=[480]",
                "task.subtasks=[niah_single]", "task.samples_per_cell=2", "task.depths=[50]",
                "runner.batch_size=2", "task.max_new_tokens=8",
                f"runner.results_root={tmp_path / 'r'}"))
    assert not (tmp_path / "r").exists()


def test_a_stop_requested_by_a_signal_takes_effect_at_the_next_write():
    """A KeyboardInterrupt raised inside a finalizer is dropped by Python; the request the
    handler recorded is raised again by the next storage write (prefill chunk, decode step)."""
    from kvcore import guards
    from kvcore.paged import PagedKV
    from kvcore.storage import ContiguousRows

    rows, paged = ContiguousRows(), PagedKV(4).rows(0, "k")
    guards.request_stop()
    try:
        for storage in (rows, paged):
            with pytest.raises(KeyboardInterrupt):
                storage.append(torch.zeros(1, 2, 3, 8))
    finally:
        guards.clear_stop()
    rows.append(torch.zeros(1, 2, 3, 8))
    assert rows.length == 3
