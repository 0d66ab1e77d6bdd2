"""Shared fixtures: tiny random models built in code (a GQA Llama and the other families of
tests/models.py), stories260K and SmolLM2 (offline)."""

import dataclasses
import os

# Before torch/triton load: passive OpenMP waits (2-core machines), Triton kernels run in the
# interpreter on CPU (it must be set before any @triton.jit module is imported), no network.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# The helpers assert on behalf of many tests: rewritten like test modules, so a failure there
# shows its diff rather than a bare AssertionError (before anything imports them).
pytest.register_assert_rewrite("tests.helpers")

import torch  # noqa: E402

from harness.core import hf_adapter
from harness.core import models  # noqa: E402
from harness.core.engine import Engine, EngineSettings  # noqa: E402


def _share_the_cores() -> None:
    """Under pytest-xdist (`make test`) the workers share the cores: each takes its share of
    torch threads, since torch's default of one per core would oversubscribe them."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


_share_the_cores()

STORIES = models.SHARED_DIR / "models" / "stories260K"
DATA = models.SHARED_DIR / "data"
PROJECT = Path(__file__).resolve().parents[1]


def pytest_addoption(parser):
    parser.addoption("--method", default=None, metavar="NAME",
                     help="only one method's checks: the shared ones parametrized by method name "
                          "and its own tests/methods/test_NAME.py (`make test-method M=NAME`)")


def pytest_collection_modifyitems(config, items):
    method = config.getoption("--method")
    if method:
        only_method(config, items, method)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def only_method(config, items, method: str) -> None:
    """Keep `method`'s cases: those whose `name` parameter is `method` (the shared checks
    parametrized by method, in tests/methods/contract and tests/harness alike), its own
    tests/methods/test_<method>.py, and the contract's checks over every method at once; drop
    every other case. The shared checks that apply (with their case counts) and those with no
    case for `method` are named at the end of the run."""
    from methods import available_methods

    names = set(available_methods())
    own = f"test_{method}.py"
    keep, drop, shared, applies = [], [], set(), {}
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        check = f"{item.path.parent.name}/{item.path.name}::{item.originalname}"
        by_method = params.get("name") in names
        if by_method:
            shared.add(check)
        if by_method:
            kept = params["name"] == method
        else:  # its own file; the checks over every method at once: the contract's, and
            # the generated methods table and pages (a new method's line must be in them)
            kept = item.path.name in (own, "test_methods_table.py") \
                or item.path.parent.name == "contract"
        if kept:
            keep.append(item)
            if by_method:
                applies[check] = applies.get(check, 0) + 1
        else:
            drop.append(item)
    config.hook.pytest_deselected(items=drop)
    items[:] = keep
    config.stash[_APPLYING] = sorted(applies.items())
    config.stash[_NOT_APPLYING] = sorted(shared - set(applies))


_APPLYING = pytest.StashKey[list]()
_NOT_APPLYING = pytest.StashKey[list]()


def pytest_terminal_summary(terminalreporter, config):
    applying = config.stash.get(_APPLYING, None)
    if applying:
        terminalreporter.section(f"shared checks for {config.getoption('--method')}")
        for check, cases in applying:
            terminalreporter.write_line(f"applies ({cases} case{'s' * (cases > 1)}): {check}")
    missing = config.stash.get(_NOT_APPLYING, None)
    if missing:
        terminalreporter.section(f"shared checks with no case for {config.getoption('--method')}")
        for check in missing:
            terminalreporter.write_line(f"does not apply: {check}")


def need_shared(path: Path) -> None:
    if not path.exists():
        pytest.skip(f"{path} is absent: the shared models/data folder is not next to the project")


@pytest.fixture
def shared_folder():
    """The test reads stories260K and the shared data: skipped where they are absent."""
    need_shared(STORIES)
    need_shared(DATA)


@pytest.fixture
def no_weight_loading(monkeypatch):
    """Any attempt to load weights fails the test: errors must come before."""
    def refuse(*a, **k):
        raise AssertionError("weights were loaded before the bad input was refused")

    monkeypatch.setattr(models, "load_model", refuse)


@pytest.fixture
def torch_path(monkeypatch):
    """Plain CPU dispatch, as a CPU run: without TRITON_INTERPRET (set above for the kernels'
    tests) KIVI's quantizer takes its torch reference and decode attention the C kernel
    (methods/kernels/kivi_cpu.c)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture
def eight_gib(monkeypatch):
    """The machine has 8 GiB available, whatever this one has (the estimates are compared)."""
    from kvcore import guards

    monkeypatch.setattr(guards, "available_bytes", lambda device: 8 * 2**30)


@pytest.fixture(scope="session")
def tiny_model():
    return models.tiny_llama()


@pytest.fixture(scope="session")
def family_models():
    """`get(family, layers)`: the session's tiny random model of a family (tests/models.py),
    built once per (family, layers)."""
    from tests.models import tiny_family_model

    built = {}

    def get(family: str, layers: int = 2):
        if (family, layers) not in built:
            built[family, layers] = tiny_family_model(family, layers)
        return built[family, layers]

    return get


@pytest.fixture(scope="session")
def stories():
    need_shared(STORIES)
    spec = models.resolve_model({"name": "stories260k", "device": "cpu"})
    return models.load_model(spec)


@pytest.fixture(scope="session")
def smollm2():
    spec = models.resolve_model({"name": "smollm2_135m", "device": "cpu"})
    return models.load_model(spec)


def make_engine(model, method, tokenizer=None, chunk=512, check_budget=True,
                protocol=None) -> Engine:
    """An engine as the runner builds it (prepare() included), for tests."""
    info = hf_adapter.model_info(model.config)
    hf_adapter.prepare(method, model, tokenizer, info, data_dir=DATA)
    settings = EngineSettings(prefill_chunk_tokens=chunk, check_budget=check_budget)
    if protocol is not None:
        settings = dataclasses.replace(settings, protocol=protocol)
    return Engine(model, tokenizer, method, info, settings)


@pytest.fixture
def data_dir():
    need_shared(DATA)
    return DATA
