"""A method's refusal as one line (`validate` before any weights load), the model shapes it is
validated against, and a HeadKV head-scores file written for it."""

import json

from methods.model import ModelInfo

INFO = ModelInfo(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_positions=512,
                 rope_theta=10000.0)
HUGE_MODEL = ModelInfo(num_layers=5, num_heads=8, num_kv_heads=4, head_dim=8,
                       max_positions=10**12, rope_theta=10000.0)  # claims 10^12 positions


def one_reason(method, info=INFO) -> str:
    reasons = method.validate(info, {"batch_size": 1})
    assert reasons, "accepted"
    assert all("\n" not in r for r in reasons)
    return "; ".join(reasons)


def head_scores(path, value_of):
    table = {f"{l}-{h}": value_of(l, h) for l in range(2) for h in range(4)}
    path.write_text(json.dumps(table) + "\n")
    return path
