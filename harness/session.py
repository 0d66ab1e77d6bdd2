"""One entry path: compose -> validate every setting (no weights) -> load model, tokenizer once ->
one engine per setting.

A `Session` holds the settings of one model and one task (a single run is a session of one;
a sweep, harness.sweep.execute, a session of many). Every setting is composed and validated
before any weights load; the model and tokenizer then load once and `engine(setting)` builds
each setting's method (prepare included) and engine over them. The CLI and the sweep compose
settings from Hydra configs (`compose`); lm-eval's model and the benchmarks, which feed the
engine themselves, build them from plain parts (`setting`, `of_methods`, task `OwnFeed`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

from omegaconf import DictConfig, OmegaConf

from harness.config.runner import (RunnerSettings, check_prompts, checking_tokenizer,
                                   engine_settings, plain, setting_reasons, split_name)
from kvcore.errors import ConfigError, UnsupportedCombination, UnsupportedReason
from tasks.base import Task

log = logging.getLogger("harness")


@dataclass
class Setting:
    """One composed and checked config: a method and its knobs, a task, the runner."""

    cfg: DictConfig
    runner: RunnerSettings
    model_cfg: dict[str, Any]
    method_name: str
    method: Any  # methods.base.KVMethod
    task_name: str
    task: Any  # tasks.base.Task
    identity: str  # harness.config.multirun.config_hash
    prepared: dict[str, Any] = field(default_factory=dict)
    is_prepared: bool = False  # its method prepared (Session.engine), `prepared` its facts
    side_files: list[dict[str, Any]] = field(default_factory=list)  # read by validate, prepare

    @property
    def label(self) -> str:
        knobs = ",".join(f"{k}={v}" for k, v in self.method.hyperparameters().items()
                         if k in self.method.axis_keys and v is not None)
        return f"{self.method_name}" + (f"({knobs})" if knobs else "")


def compose(cfg: DictConfig, choices: dict[str, str] | None = None) -> Setting:
    """Every check of one config that needs no model (keys, types, runner, method, task).
    `choices`: the config file chosen per group (a sweep member's; by default the Hydra job's)."""
    from harness.config.config_check import check_config
    from harness.report.loggers import check_logger
    from harness.config.multirun import config_hash
    from methods import build_method
    from tasks import build_task

    check_config(cfg)  # every key declared (`+` keys too), no NaN/inf, types of YAML knobs
    runner = RunnerSettings.of(plain(cfg.runner))
    choices = choices or {}
    method_name, method_opts = split_name("method", cfg.method, choices.get("method"))
    task_name, task_opts = split_name("task", cfg.task, choices.get("task"))
    check_logger(plain(cfg.logger))
    method = build_method(method_name, **method_opts)
    task = build_task(task_name, **task_opts)
    return Setting(cfg, runner, plain(cfg.model), method_name, method, task_name, task,
                   config_hash(cfg))


def runner_of(**knobs: Any) -> dict[str, Any]:
    """The runner's declared defaults (conf/runner/default.yaml) with `knobs` changed, for a
    caller that composes no Hydra config (`setting`)."""
    return RunnerSettings.of(knobs).as_dict()


@dataclass(kw_only=True)
class OwnFeed(Task):
    """The task of a caller that feeds the engine itself (lm-eval's requests, a benchmark's own
    prompts), as the checks before weights see it: prompts prefilled, then decode steps, several
    sequences decoded together; no data files, no prompts to check."""

    name: ClassVar[str] = "own_feed"
    main_metric: ClassVar[str] = "none"
    higher_is_better: ClassVar[bool] = True
    batches: ClassVar[bool] = True


def setting(model_cfg: dict[str, Any], runner: Mapping[str, Any], method, task: Task) -> Setting:
    """One setting from plain parts, for a caller that composes no Hydra config (lm-eval's
    --model_args, a benchmark): the model group's keys, a full runner (`runner_of`), a built
    method (methods.build_method) and a task (`OwnFeed` where the caller feeds the engine
    itself). The runner is checked as `compose` checks it (a key left out keeps its default);
    the rest by `Session.validate`."""
    from harness.config.multirun import config_hash

    checked = RunnerSettings.of(runner)
    cfg = OmegaConf.create({"model": dict(model_cfg), "runner": checked.as_dict(),
                            "method": {"name": method.name, **method.hyperparameters()},
                            "task": {"name": task.name, **task.options()}})
    return Setting(cfg, checked, dict(model_cfg), method.name, method, task.name, task,
                   config_hash(cfg))


def of_methods(model_cfg: dict[str, Any], methods: dict[Any, Any], task: Task | None = None,
               row_knobs: dict[Any, dict[str, Any]] | None = None,
               **runner_knobs: Any) -> tuple["Session", dict[Any, Setting]]:
    """A session of built methods (row -> KVMethod) over one model, for a caller that feeds the
    engines itself (a benchmark: `task` by default `OwnFeed`); every row's runner has
    `runner_knobs`, and its own `row_knobs[row]` where given. Every setting is validated, no
    weights loaded yet; a refused one raises ConfigError naming its row. Then `load(...)` and
    `engine(settings[row])`."""
    row_knobs = row_knobs or {}
    settings = {row: setting(model_cfg, runner_of(**runner_knobs, **row_knobs.get(row, {})),
                             method, task or OwnFeed())
                for row, method in methods.items()}
    session = Session(list(settings.values()))
    for row, one in settings.items():
        try:
            session.validate(one)
        except ConfigError as exc:
            raise ConfigError(f"{row}: {exc}") from None
    return session, settings


class Session:
    """The settings of one model and one task; the model and tokenizer load once for all."""

    def __init__(self, settings: list[Setting]):
        if not settings:
            raise ConfigError("a session needs at least one setting")
        first = settings[0]
        for s in settings[1:]:
            if s.model_cfg != first.model_cfg:
                raise ConfigError(f"a sweep shares one model: model={s.model_cfg.get('name')} "
                                  f"differs from model={first.model_cfg.get('name')}")
            if s.runner.attn_impl != first.runner.attn_impl:
                raise ConfigError(f"a sweep loads the model once, with one attention: "
                                  f"runner.attn_impl={s.runner.attn_impl} differs from "
                                  f"{first.runner.attn_impl}")
            if s.task_name != first.task_name or s.task.options() != first.task.options():
                raise ConfigError(f"a sweep shares one task: task={s.task_name} "
                                  f"{s.task.options()} differs from task={first.task_name} "
                                  f"{first.task.options()}")
        self.settings = settings
        self.model = self.tokenizer = None
        self._checking_tokenizer = None  # loaded by the first `validate`
        # KVMethod.prepare_key -> (its artefacts, KVMethod.artefacts; its facts; the side files
        # read)
        self._prepared: dict[str, tuple[dict, dict, list]] = {}
        from harness.core import hf_adapter
        from harness.core import models

        spec = models.resolve_model(first.model_cfg)
        self.config = models.load_config(spec)
        self.spec = models.identify(spec, self.config)  # model=hf: <folder or hub id>-<hash>
        self.info = hf_adapter.model_info(self.config, self.spec.dtype)

    @classmethod
    def of(cls, cfgs: list[DictConfig]) -> "Session":
        return cls([compose(cfg) for cfg in cfgs])

    def ready(self) -> list:
        """Every setting validated, then the model loaded once: one engine per setting, in
        order (a caller that needs no step in between)."""
        for s in self.settings:
            self.validate(s)
        self.load(self.settings[0].runner.attn_impl)
        return [self.engine(s) for s in self.settings]

    def reasons(self, setting: Setting) -> list[str]:
        """Why this setting cannot run on this model (method x task x protocol x storage)."""

        return setting_reasons(setting.method, setting.task, self.info, setting.runner,
                               self.spec.device)

    def validate(self, setting: Setting) -> None:
        """Every check before weights load, one ConfigError naming the key."""

        with _recording(setting):
            reasons = self.reasons(setting)
        if reasons:  # each once (a side file is checked by kind, then read by its method)
            unsupported = all(isinstance(r, UnsupportedReason) for r in reasons)
            error = UnsupportedCombination if unsupported else ConfigError
            raise error("; ".join(dict.fromkeys(reasons)))
        setting.task.check_data()
        if self._checking_tokenizer is None:  # one load for every setting

            self._checking_tokenizer = checking_tokenizer(self.spec)
        check_prompts(setting.task, self.spec, self.info, setting.method, self.config,
                      self._checking_tokenizer)

    def load(self, attn_impl: str) -> None:
        """Weights and tokenizer, once."""
        from harness.core import models

        if self.model is None:
            log.info("loading %s", self.spec.description)
            self.model, self.tokenizer = models.load_model(self.spec, attn_impl)

    def engine(self, setting: Setting):
        """The setting's method prepared on the loaded model (once: a later call gives a fresh
        engine over the same prepared method), and its engine."""
        from harness.core.engine import Engine

        if setting.method.needs_prepare() and not setting.is_prepared:
            self._prepare(setting)
            setting.is_prepared = True
        return Engine(self.model, self.tokenizer, setting.method, self.info,
                      engine_settings(setting.runner))

    def _prepare(self, setting: Setting) -> None:
        """`prepare` the setting's method, or give it the artefacts of a setting prepared
        before with the same `KVMethod.prepare_key` (its prepare read only what this one's
        reads alike): its artefacts (`KVMethod.artefacts`), its facts and the side files read."""
        from harness.core import hf_adapter
        from harness.core import models

        method = setting.method
        key = method.prepare_key()
        done = self._prepared.get(key) if key is not None else None
        if done is not None:
            artefacts, facts, side_files = done
            method.adopt_artefacts(artefacts)
            setting.prepared = dict(facts)
            setting.side_files += [f for f in side_files if f not in setting.side_files]
            return
        with _recording(setting):
            setting.prepared = hf_adapter.prepare(method, self.model, self.tokenizer, self.info,
                                                  data_dir=models.SHARED_DIR / "data")
        if key is not None:
            self._prepared[key] = (method.artefacts(), dict(setting.prepared),
                                   list(setting.side_files))


@contextmanager
def _recording(setting: Setting):
    """The side files read inside the block, added to the setting's record (metrics.json)."""
    from methods import _sidefiles as sidefiles

    sidefiles.reset()
    try:
        yield
    finally:
        seen = {(f["key"], f["path"]) for f in setting.side_files}
        setting.side_files += [f for f in sidefiles.read() if (f["key"], f["path"]) not in seen]
