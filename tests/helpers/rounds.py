"""A stand-in launcher for the rounds driver (harness.sweep.rounds): run folders with planted
per-sample scores, written as the harness's launchers would, without a model."""

import json
from pathlib import Path

import numpy as np

# planted pass rates per method: the fake launcher scores sample i as a pass when u[i] < p
PLANTED = {"full": 0.8, "same": 0.8, "bad": 0.05, "close": 0.7}
U = np.random.default_rng(0).random(400)


class FakeLaunch:
    """Writes each job's run folder (RULER-shaped samples.jsonl) and status as a launcher would;
    `cut_at`: raise when that round's batch comes (the process killed mid-sweep)."""

    def __init__(self, sweep_dir, cut_at=None):
        self.sweep_dir, self.cut_at, self.ran, self.batches = sweep_dir, cut_at, [], 0

    def __call__(self, batch, first):
        self.batches += 1
        if self.batches == self.cut_at:
            raise KeyboardInterrupt
        for k, job in enumerate(batch):
            o = dict(part.split("=", 1) for part in job)
            method, offset, limit = o["method"], int(o["task.skip_samples"]), int(o["task.limit"])
            status = self.sweep_dir / "status" / f"{first + k:04d}.json"
            status.parent.mkdir(parents=True, exist_ok=True)
            if method == "refused":  # as the harness skips a combination it cannot run
                status.write_text(json.dumps({"status": "skipped", "detail": "no budget knob"}))
                continue
            self.ran += [(method, i) for i in range(offset, offset + limit)]
            folder = Path(o["runner.results_root"]) / method / f"run-{first + k}"
            folder.mkdir(parents=True)
            rows = [{"sample_id": f"s{i}", "subtask": "niah_single", "length_tokens": 320,
                     "score": float(U[i] < PLANTED[method])} for i in range(offset, offset + limit)]
            (folder / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            status.write_text(json.dumps({"status": "ok", "detail": str(folder)}))
