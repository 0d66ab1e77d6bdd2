"""kv-harness: one engine, one method interface, every task.

The runner lives in `harness.run` (`python -m harness`), the prefill/decode loop in
`harness.core.engine`, and the only code touching transformers internals in `harness.core.hf_adapter`.
`harness.api` runs a method inside transformers' own `generate`.
"""

from pathlib import Path

# The Hydra configs: conf/ at the checkout's root; a wheel ships them inside this package
# (pyproject.toml maps conf/ to harness/conf), so an installed harness finds its own.
_SHIPPED = Path(__file__).resolve().parent / "conf"
CONF_DIR = _SHIPPED if _SHIPPED.is_dir() else Path(__file__).resolve().parents[1] / "conf"
