"""lm-eval tasks (COPA, PIQA, WinoGrande, OpenBookQA, RTE, LAMBADA, ...) through the KV method.

`lm_eval.simple_evaluate` runs with our `kvharness` LM (`harness.lm_eval.KVHarnessLM`) over the
runner's Engine, so every request is prefilled and scored through the configured KV method. With
`offline: true` (default) the tasks are our offline YAMLs (`tasks/lm_eval_tasks/`, written by
`harness.lm_eval.tasks.offline_task_dir` for `data_dir`): lm-eval's own task definitions (the
standard names and prompts, via `include`) over the local copies in ../shared/data, loaded with
`TaskManager(include_path=..., include_defaults=False)`. With `offline: false`, any lm-eval task
name is accepted and its data comes from the Hugging Face hub (needs network). `include_path`
adds folders of your own lm-eval task YAMLs (e.g. `dataset_path: json` over local `data_files`);
their task names are accepted either way, and are loaded (data included) before the weights, so
that a broken YAML or a missing data file is one error line.

Protocol choices (recorded in metrics.json):
  * `num_fewshot: 5` by default, as in the InfiniGen and H2O papers (which ran lm-eval 0.3).
    Offline there is no training split: few-shot examples are drawn from the evaluated split with
    the evaluated document left out (lm-eval's own rule when the few-shot split is the test
    split), with lm-eval's default few-shot seed (1234). 0-shot prompts equal lm-eval's exactly.
  * `scoring: stepwise` by default: the context is prefilled through the method (in
    `runner.prefill_chunk_tokens` chunks), then each answer token is one decode step, so methods
    that act per step (eviction, selection) act between answer tokens as in generation.
    `chunked` scores the answer in one pass over the compressed cache (faster; the method acts
    on the context only). With the full cache both equal lm-eval's `hf` model to ~1e-5.
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from kvcore.errors import ConfigError
from tasks.base import Task, TaskResult, content_id

if TYPE_CHECKING:
    from harness.core.engine import Engine

SCORING = ("stepwise", "chunked")
DEFAULT_FEWSHOT_SEED = 1234  # lm-eval's default fewshot_random_seed: prompts match lm-eval runs


@dataclass(kw_only=True)
class LMEval(Task):
    name: ClassVar[str] = "lm_eval"
    main_metric: ClassVar[str] = "acc_mean"  # mean acc over task.names (one name: its acc)
    higher_is_better: ClassVar[bool] = True
    # lm-eval's requests are served by KVHarnessLM over the engine itself (requests, batches,
    # rewound contexts, its accounting)
    needs_live_engine: ClassVar[bool] = True
    names: list[str] = field(default_factory=lambda: ["copa"])  # lm-eval task names
    num_fewshot: int | None = 5  # examples per prompt (null: each task's own default, 0 here)
    scoring: str = "stepwise"  # stepwise | chunked
    data_dir: str | None = None  # local copies (default ../shared/data)
    offline: bool = True  # true: our offline YAMLs only; false: lm-eval's own tasks (hub data)
    seed: int = DEFAULT_FEWSHOT_SEED  # few-shot sampling seed (lm-eval's default)
    include_path: list[str] | str | None = None  # folders of your own lm-eval task YAMLs

    def check_options(self) -> list[str]:
        reasons = []
        names = self.names
        if isinstance(names, str):
            names = self.names = [n for n in names.split(",") if n]
        if (not isinstance(names, (list, tuple)) or not names
                or not all(isinstance(n, str) and n for n in names)):
            reasons.append(f"task.names={self.names!r} must be a non-empty list of lm-eval task "
                           "names, e.g. [copa,piqa]")
        else:
            self.names = list(names)
        if self.num_fewshot is not None and (not isinstance(self.num_fewshot, int)
                                             or isinstance(self.num_fewshot, bool)
                                             or self.num_fewshot < 0):
            reasons.append(f"task.num_fewshot={self.num_fewshot!r} must be an integer >= 0 or null")
        if self.scoring not in SCORING:
            reasons.append(f"task.scoring={self.scoring!r}; allowed: {', '.join(SCORING)}")
        if not isinstance(self.offline, bool):
            reasons.append(f"task.offline={self.offline!r} must be true or false")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            reasons.append(f"task.seed={self.seed!r} must be an integer")
        reasons += self._check_include_path()
        if not reasons and self.offline:
            from harness.lm_eval.tasks import TASK_FILES

            known = set(TASK_FILES) | self._own_tasks()
            unknown = [n for n in self.names if n not in known]
            if unknown:
                mine, also = ((" and is not a task of task.include_path",
                               "the tasks of task.include_path") if self.include_path
                              else ("", "your own task YAMLs in task.include_path"))
                reasons.append(f"task.names: {unknown[0]!r} has no offline copy{mine}; allowed "
                               f"with task.offline=true: {', '.join(TASK_FILES)}, or {also}")
        return reasons

    def _check_include_path(self) -> list[str]:
        paths = self.include_path
        if paths is None or paths == []:
            self.include_path = []
            return []
        if isinstance(paths, str):
            paths = [paths]
        if not isinstance(paths, (list, tuple)) or not all(isinstance(p, str) and p
                                                           for p in paths):
            return [f"task.include_path={self.include_path!r} must be a folder or a list of "
                    "folders of lm-eval task YAMLs"]
        resolved = []
        for path in paths:
            folder = Path(path).expanduser()
            if not folder.is_dir():
                return [f"task.include_path={path}: no such folder (a folder of lm-eval task "
                        "YAMLs)"]
            resolved.append(str(folder.resolve()))
        self.include_path = resolved
        return []

    def _included_manager(self):
        """The TaskManager of task.include_path, built (its folders indexed) once."""
        if getattr(self, "_own_manager", None) is None:
            from lm_eval.tasks import TaskManager

            self._own_manager = TaskManager(include_path=list(self.include_path),
                                            include_defaults=False)
        return self._own_manager

    def _own_tasks(self) -> set[str]:
        """Task names defined in task.include_path (none without it)."""
        return set(self._included_manager().all_tasks) if self.include_path else set()

    def _offline_names(self) -> list[str]:
        from harness.lm_eval.tasks import TASK_FILES

        if not self.offline:
            return []
        own = self._own_tasks()
        return [n for n in self.names if n in TASK_FILES and n not in own]

    def check_data(self) -> None:
        offline = self._offline_names()
        if offline:
            from harness.lm_eval.tasks import check_task_data, offline_task_dir

            check_task_data(offline, self.data_dir)
            self._task_dir = offline_task_dir(self.data_dir)
        if self.include_path:  # your own YAMLs: build them (and read their data) now
            manager = self._included_manager()
            for name in self.names:
                if name in manager.all_tasks:
                    try:
                        loaded = manager.load([name])
                    except Exception as exc:  # lm-eval / datasets error: name the task and why
                        text = " ".join(str(exc).split())
                        raise ConfigError(f"task.include_path: lm-eval could not load task "
                                          f"{name!r} ({type(exc).__name__}: {text})"
                                          f"{bad_data_line(manager, name)}") from None
                    for task_name, task in loaded["tasks"].items():
                        self._check_fewshot_pool(task_name, task)

    def _check_fewshot_pool(self, name: str, task) -> None:
        """lm-eval draws num_fewshot examples (one more when they come from the evaluated split,
        to leave the evaluated document out) and fails only after the weights load; a task
        whose config pins num_fewshot: 0 ignores task.num_fewshot, as lm-eval does."""
        shots = 0 if task.get_config("num_fewshot") == 0 else self.num_fewshot
        if not shots:
            return
        pool = len(task.fewshot_docs() or ())
        if pool <= shots:
            raise ConfigError(f"task.num_fewshot={shots} but lm-eval task {name!r} has only "
                              f"{pool} document(s) to draw few-shot examples from (it needs more "
                              f"than {shots}); use a smaller task.num_fewshot")

    def _task_manager(self):
        from lm_eval.tasks import TaskManager

        own = list(self.include_path or [])
        if not self.offline:
            return TaskManager(include_path=own or None)
        folders = []
        if self._offline_names():
            from harness.lm_eval.tasks import offline_task_dir

            folders.append(str(getattr(self, "_task_dir", None)
                               or offline_task_dir(self.data_dir)))
        # later folders override earlier ones: your own task of a standard name wins
        return TaskManager(include_path=folders + own, include_defaults=False)

    def evaluate(self, engine: "Engine") -> TaskResult:
        import lm_eval
        from lm_eval import simple_evaluate

        from harness.lm_eval import KVHarnessLM

        lm = KVHarnessLM(engine, scoring=self.scoring)
        manager = self._task_manager()
        names = expand_tags(self.names, manager)
        out = simple_evaluate(model=lm, tasks=names, num_fewshot=self.num_fewshot,
                              limit=self.limit, task_manager=manager,
                              log_samples=True, fewshot_random_seed=self.seed)
        metrics, samples = summarize(out, names)
        shots = {n: out["n-shot"].get(n) for n in names}
        protocol = {
            "lm_eval_version": getattr(lm_eval, "__version__", None),
            "tasks": names, "num_fewshot": shots, "fewshot_seed": self.seed,
            "scoring": self.scoring, "limit": self.limit, "offline": self.offline,
            "task_versions": {n: out["versions"].get(n) for n in names},
            "include_path": list(self.include_path or []),
            "prompts": "lm-eval's own task definitions" + (
                " (included) over local copies; few-shot examples from the evaluated split, "
                "the evaluated document left out" if self.offline else " (hub data)")
                + ("; task.include_path's own YAMLs for its tasks" if self.include_path else ""),
            "max_length_tokens": lm.max_length,
        }
        return TaskResult(metrics=metrics, samples=samples, protocol=protocol)


def expand_tags(names: list[str], manager) -> list[str]:
    """`names` with each lm-eval tag (a set of tasks that gets no result of its own, unlike a
    group) replaced by its tasks, in name order; duplicates dropped."""
    tags = set(manager.all_tags)
    expanded = []
    for name in names:
        expanded += sorted(manager.task_index[name].tags) if name in tags else [name]
    return list(dict.fromkeys(expanded))


def _leaves(out: dict[str, Any], name: str) -> list[str]:
    """The evaluated tasks under `name`: itself, or a group's subtasks (recursively)."""
    subtasks = out.get("group_subtasks", {}).get(name)
    if not subtasks:
        return [name]
    return [leaf for sub in subtasks for leaf in _leaves(out, sub)]


def _sample_row(task: str, s: dict[str, Any]) -> dict[str, Any]:
    """One logged lm-eval document (for one filter) as a samples.jsonl row."""
    row = {"task": task, "doc_id": s["doc_id"], "target": s["target"],
           "sample_id": content_id([task, s["arguments"]], s["target"])}
    if s.get("filter", "none") != "none":
        row["filter"] = s["filter"]
    resps, args = s["filtered_resps"], s["arguments"][0]
    if len(args) == 1:  # loglikelihood_rolling (the document): its summed log-probability
        row["loglikelihood"] = float(resps[0])
    elif isinstance(args[1], dict):  # generate_until (context, gen_kwargs): the texts
        row["generation"] = s["resps"][0][0]
        row["prediction"] = resps[0]  # after the filter (e.g. the regex's answer)
    elif len(resps) > 1:  # multiple choice: the answer is the most likely choice
        lls = [float(r[0]) for r in resps]
        row["prediction"] = max(range(len(lls)), key=lls.__getitem__)
        row["loglikelihoods"] = lls
    else:  # loglikelihood task: whether greedy decoding produces the target
        row["prediction_is_greedy"] = bool(resps[0][1])
        row["loglikelihood"] = float(resps[0][0])
    for metric in s.get("metrics", ()):  # lm-eval's per-document values that are one number
        value = s.get(metric)  # (a perplexity's per-document value is a loglikelihood: left out)
        if (isinstance(value, numbers.Real) and not isinstance(value, bool)
                and "perplexity" not in metric):
            row[metric] = float(value)
    return row


def summarize(out: dict[str, Any], names: list[str]) -> tuple[dict[str, Any], list[dict]]:
    """lm-eval's output -> flat metrics `<task>/<metric>` (+ stderr, samples), per-doc samples.

    A metric computed after a filter other than lm-eval's default "none" keeps the filter in its
    name, as lm-eval writes it: `gsm8k/exact_match,strict-match`. A group reports its own
    aggregated metrics and the samples of its subtasks."""
    metrics: dict[str, Any] = {}
    accs = []
    for name in names:
        for key, value in out["results"][name].items():
            metric, comma, filt = key.partition(",")
            if (not comma or not isinstance(value, numbers.Real)
                    or isinstance(value, bool)):
                continue  # the alias, sample_len, and "N/A" stderrs
            metrics[f"{name}/{metric}" if filt == "none" else f"{name}/{key}"] = float(value)
        metrics[f"{name}/samples"] = sum(int(out["n-samples"][leaf]["effective"])
                                         for leaf in _leaves(out, name))
        if f"{name}/acc" in metrics:
            accs.append(metrics[f"{name}/acc"])
    if accs:  # the task's main metric, also for one name (its acc), so reports rank by it
        metrics["acc_mean"] = sum(accs) / len(accs)
    samples = []
    leaves = dict.fromkeys(leaf for name in names for leaf in _leaves(out, name))
    for leaf in leaves:
        samples.extend(_sample_row(leaf, s) for s in out["samples"][leaf])
    return metrics, samples


def bad_data_line(manager, name: str) -> str:
    """Where the local JSON-lines data files of task `name` (its YAML's
    `dataset_kwargs.data_files`) first fail to parse, as "; <file> line <n>: <why>" ("" when
    they parse: the error is elsewhere). lm-eval and datasets report a bad line without the file
    or the line."""
    cfg = getattr(manager.task_index.get(name), "cfg", None) or {}
    files = (cfg.get("dataset_kwargs") or {}).get("data_files")
    files = list(files.values()) if isinstance(files, dict) else [files]
    paths = [Path(p) for f in files for p in (f if isinstance(f, list) else [f])
             if isinstance(p, str) and p.endswith(".jsonl")]
    for path in paths:
        try:
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            continue
        for number, line in enumerate(lines, 1):
            try:
                if line.strip():
                    json.loads(line)
            except ValueError as exc:
                return f"; {path} line {number}: {exc}"
    return ""
