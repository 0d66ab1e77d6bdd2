"""Projected decode time on another machine from this run's transfer ledger (`hardware=...`).

Labelled as projected, never as measured: a hardware profile (`conf/hardware/*.yaml`: achieved
host-to-device link bandwidth and device memory bandwidth) turns the measured bytes moved per
decode step into link time, which is combined with the compute time measured in this run:
  compute_ms   = measured decode ms/token - measured exposed transfer ms per decode step
  transfer_ms  = bytes host->device per decode step / link bandwidth
  serial_ms    = compute_ms + transfer_ms      (no overlap)
  overlapped_ms= max(compute_ms, transfer_ms)  (perfect overlap: a lower bound)
methods.md §8.3 argues the prefetch is not hideable on PCIe, so serial is the realistic figure;
the compute part is from *this* machine, so the projection answers "what would the moves cost
there", not "how fast is that GPU".
"""

from __future__ import annotations


def project(hardware: dict, speed: dict, transfer: dict) -> dict | None:
    if not hardware or hardware.get("name") in (None, "none"):
        return None
    decode_ms = speed.get("decode_ms_per_token_median")
    steps = transfer.get("decode_steps") or 0
    per_step = transfer.get("bytes_per_decode_step") or 0.0
    if decode_ms is None or not steps:
        return {"label": "projected", "hardware": hardware["name"], "note": "no decode steps"}
    exposed_per_step = (transfer.get("exposed_ms") or 0.0) / steps
    compute_ms = max(decode_ms - exposed_per_step, 0.0)
    transfer_ms = per_step / (float(hardware["link_gb_per_s"]) * 1e6)
    return {
        "label": "projected (compute measured on this run's device + modelled link time)",
        "hardware": hardware["name"],
        "link_gb_per_s": hardware["link_gb_per_s"],
        "compute_ms_measured": round(compute_ms, 4),
        "transfer_ms": round(transfer_ms, 4),
        "decode_ms_serial": round(compute_ms + transfer_ms, 4),
        "decode_ms_overlapped": round(max(compute_ms, transfer_ms), 4),
    }
