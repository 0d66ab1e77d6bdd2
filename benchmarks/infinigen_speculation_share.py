"""InfiniGen's speculation cost: its share of decode step time (CPU: wall clock).

    python benchmarks/infinigen_speculation_share.py --context 1024 --new-tokens 32 --rounds 3

Prefills `--context` tokens of an essay text, then decodes `--new-tokens` greedily in system mode
(the full K/V on the host tier, selected rows gathered and copied per step). Every call of
`InfiniGenLayer.speculate` (the partial query, partial scores, threshold count, top-k) is timed
with perf_counter (on CUDA after a device synchronize on both sides, which serialises the step:
use the CUDA numbers as an upper bound). Prints per round the median decode ms/step, the median
speculation ms/step and their ratio, and the medians over rounds; records threads and load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from harness.core import models  # noqa: E402
from harness.session import of_methods  # noqa: E402
from kvcore.errors import ConfigError  # noqa: E402
from methods import build_method  # noqa: E402
from methods.infinigen import InfiniGenLayer  # noqa: E402
from tasks.text_sources import load_text  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--overrides", nargs="*", default=[], help="method hyperparameters key=value")
    args = ap.parse_args()

    kwargs = {k: (float(v) if v.replace(".", "", 1).isdigit() else v)
              for k, v in (o.split("=", 1) for o in args.overrides)}
    try:  # checked before the weights load
        session, settings = of_methods({"name": args.model, "device": args.device},
                                       {"infinigen": build_method("infinigen", mode="system",
                                                                  **kwargs)})
    except ConfigError as exc:
        raise SystemExit(f"error: {exc}") from None
    session.load("sdpa")
    tok = session.tokenizer
    engine = session.engine(settings["infinigen"])
    ids = torch.tensor(tok(load_text("essays", None, str(models.SHARED_DIR / "data")),
                           verbose=False)["input_ids"][: args.context])
    cuda = engine.device.type == "cuda"
    spent: list[float] = []
    original = InfiniGenLayer.speculate

    def timed(layer, *a, **kw):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = original(layer, *a, **kw)
        if cuda:
            torch.cuda.synchronize()
        spent.append((time.perf_counter() - t0) * 1e3)
        return out

    InfiniGenLayer.speculate = timed
    print(f"{args.model} context {ids.numel()} + {args.new_tokens} new, threads "
          f"{torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}, overrides {args.overrides}")
    step_ms, spec_ms = [], []
    for r in range(args.rounds):
        with engine.request() as req:
            logits = req.prefill(ids.to(engine.device))
            steps, specs = [], []
            for _ in range(args.new_tokens):
                spent.clear()
                t0 = time.perf_counter()
                logits = req.step(int(logits[0, -1].argmax()))
                steps.append((time.perf_counter() - t0) * 1e3)
                specs.append(sum(spent))
        step_ms.append(statistics.median(steps))
        spec_ms.append(statistics.median(specs))
        print(f"round {r}: decode {step_ms[-1]:.2f} ms/step, speculation {spec_ms[-1]:.2f} ms/step "
              f"({spec_ms[-1] / step_ms[-1]:.1%})", flush=True)
    step, spec_ = statistics.median(step_ms), statistics.median(spec_ms)
    print(f"median over rounds: decode {step:.2f} ms/step, speculation {spec_:.2f} ms/step, "
          f"share {spec_ / step:.1%}")


if __name__ == "__main__":
    main()
