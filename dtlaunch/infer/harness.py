"""Evaluation through lm-evaluation-harness: checks on the request, one run, and its results file.

Shared by `dtlaunch eval` and the evaluation after training (training.eval_tasks). lm_eval is an
optional dependency: it is imported here, inside functions, and only on the eval path.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

from dtlaunch.config.weight_source import hf_name
from dtlaunch.errors import ConfigError, InputError
from dtlaunch.infer.eval_datasets import check_datasets_reachable, unreachable_dataset_error
from dtlaunch.infer.task_names import default_task_names, known_task_names, unknown_task_error

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

EVAL_DIR = "eval"  # RUN/eval/<time>.json
# Byte runs train on text only (data.format=chat is refused for them), so no template fits their ids.
BYTE_NO_CHAT = "trained on the byte tokenizer, which has no chat template (chat data needs a Hugging Face tokenizer)"


@dataclass(frozen=True)
class EvalRequest:
    tasks: list[str]
    limit: int = 0  # samples per task; 0 = all
    num_fewshot: int = -1  # -1 = each task's own
    batch_size: int = 8
    include: str = ""  # a directory of task YAMLs of one's own
    apply_chat_template: bool = False


TRAINING_KEYS = ("training.eval_tasks", "training.eval_include")  # the names an error shows


def eval_request(cfg: JobConfig) -> EvalRequest:
    """training.eval_* as an eval request."""
    t = cfg.training
    return EvalRequest(
        tasks=[str(x) for x in t.eval_tasks],
        limit=int(t.eval_limit),
        num_fewshot=int(t.eval_num_fewshot),
        batch_size=int(t.eval_batch_size),
        include=str(t.eval_include),
        apply_chat_template=bool(t.eval_apply_chat_template),
    )


def require_lm_eval() -> None:
    """lm_eval and what its HFLM needs (transformers, accelerate: the `hf` extra the `eval` extra names)."""
    try:
        import lm_eval.models.huggingface  # noqa: F401
    except ImportError:
        raise ConfigError("evaluation needs lm-evaluation-harness: pip install 'dtlaunch[eval]'") from None


def check_request(
    req: EvalRequest,
    key: str = "--tasks",
    include_key: str = "--include",
    datasets_here: bool = True,
    build_manager: bool = True,
) -> Any:
    """The request's TaskManager (None with `build_manager=False`, a check only), after every check that needs
    no model: numbers, the include directory, each task name (an unknown one names its closest known names;
    dtlaunch.infer.task_names) and, where the evaluation runs in this environment (`datasets_here`), that
    offline its hub datasets are cached."""
    if not req.tasks or any(not t.strip() for t in req.tasks):
        raise ConfigError(f"{key}: give one or more task names, comma-separated (e.g. hellaswag,arc_easy)")
    if req.limit < 0 or req.batch_size < 1 or req.num_fewshot < -1:
        raise ConfigError(
            f"limit {req.limit} / batch size {req.batch_size} / num_fewshot {req.num_fewshot}: need limit >= 0 "
            f"(0 = all), batch size >= 1, num_fewshot >= 0 (or -1 for each task's own)"
        )
    if req.include and not Path(req.include).expanduser().is_dir():
        raise InputError(f"{include_key} {req.include}: no such directory; give a directory of task YAML files")
    if build_manager:
        require_lm_eval()  # what evaluating needs, before the task names
    include = str(Path(req.include).expanduser().resolve()) if req.include else ""
    check_task_names(req.tasks, include, key)
    offline_check = datasets_here and _hub_offline()
    if not (build_manager or offline_check):
        return None
    manager = task_manager_for(include, req.tasks)
    if offline_check:  # offline: seconds here, not after the load
        check_datasets_reachable(manager, req.tasks, key, include_key)
    return manager


def check_task_names(tasks: Sequence[str], include: str, key: str) -> None:
    """Every name known to `include`'s YAMLs or to lm-eval (its names from a per-install cache file)."""
    local = known_task_names(include, with_defaults=False) if include else set()
    if all(name in local for name in tasks):
        return
    problem = unknown_task_error(tasks, local | set(default_task_names()), key)
    if problem:
        raise problem


def _hub_offline() -> bool:
    from datasets import config

    return bool(config.HF_HUB_OFFLINE)


def task_manager_for(include: str, tasks: Sequence[str]) -> Any:
    """The TaskManager that knows `tasks`: `include`'s YAMLs alone when every task is a plain task there
    (indexing lm-eval's own ~15k task files costs ~8 s of CPU, the include folder milliseconds), else the
    whole index (lm-eval's tasks and groups that may name them)."""
    if include:
        local = task_manager(include, with_defaults=False)
        if all(_plain_task(local.task_index.get(name)) for name in tasks):
            return local
    return task_manager(include, with_defaults=True)


def _plain_task(entry: Any) -> bool:
    """A task defined by one YAML (or a Python class), not a group or tag that may name lm-eval's own tasks.
    Index entries are objects with a `kind` enum in current lm-eval, dicts with a "type" in older ones."""
    if entry is None:
        return False
    if isinstance(entry, dict):
        return entry.get("type") in ("task", "python_task")
    return getattr(getattr(entry, "kind", None), "name", None) in ("TASK", "PY_TASK")


@functools.lru_cache(maxsize=4)
def task_manager(include: str, with_defaults: bool = True) -> Any:
    """lm_eval's TaskManager over `include`'s YAMLs, and lm-eval's own tasks `with_defaults`: a process (the
    launcher checks before training and evaluates after it) builds each once."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    if not with_defaults:
        return TaskManager(include_path=include, include_defaults=False)
    return TaskManager(include_path=include or None)


@contextlib.contextmanager
def _git_hash_quietly() -> Iterator[None]:
    """lm-eval records `git describe --always` of the working directory, letting git print "fatal: not a
    git repository" on the terminal when it is none: the same lookup, with git's stderr discarded (the
    results file dtlaunch writes does not keep the hash)."""
    import subprocess

    from lm_eval import evaluator

    def quiet() -> Optional[str]:
        try:
            out = subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL)
        except (subprocess.CalledProcessError, FileNotFoundError):
            return None
        return out.strip().decode()

    original = evaluator.get_git_commit_hash
    evaluator.get_git_commit_hash = quiet
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = original


def evaluate(lm: Any, req: EvalRequest, manager: Any, log_samples: bool = False) -> dict:
    """lm_eval.simple_evaluate on `lm` (an lm_eval LM); its whole result dict."""
    import lm_eval

    with _git_hash_quietly():
        return lm_eval.simple_evaluate(
            model=lm,
            tasks=list(req.tasks),
            num_fewshot=None if req.num_fewshot < 0 else req.num_fewshot,
            batch_size=req.batch_size,
            limit=req.limit or None,
            apply_chat_template=req.apply_chat_template,
            task_manager=manager,
            log_samples=log_samples,
            # Same seeds every time: few-shot sampling and any sampled generation repeat run to run.
            random_seed=0,
            numpy_random_seed=1234,
            torch_random_seed=1234,
            fewshot_random_seed=1234,
        )


def metric_rows(results: dict) -> list[tuple[str, str, float, Optional[float]]]:
    """(task, metric, value, stderr) for every numeric metric of every task, in task order."""
    rows = []
    for task, metrics in results.items():
        for key, value in metrics.items():
            if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            metric, _, flt = key.partition(",")
            label = metric if flt == "none" else f"{metric} ({flt})"
            err = metrics.get(f"{metric}_stderr,{flt}")
            rows.append((task, label, float(value), float(err) if isinstance(err, (int, float)) else None))
    return rows


def results_record(out: dict, req: EvalRequest, source: str, step: Optional[int], seconds: float) -> dict:
    """The saved record: what was evaluated, how, and lm_eval's per-task metrics."""
    import lm_eval

    return {
        "source": source,
        "step": step,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "seconds": round(seconds, 2),
        "request": asdict(req),
        "lm_eval_version": getattr(lm_eval, "__version__", ""),
        "results": out["results"],
        "n_samples": out.get("n-samples", {}),
        "versions": out.get("versions", {}),
    }


def write_results(record: dict, out_dir: Path) -> Path:
    """out_dir/<time>.json (a second one in the same second gets a suffix)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = time.strftime("%Y%m%d-%H%M%S")
    path = out_dir / f"{stem}.json"
    n = 1
    while path.exists():
        path = out_dir / f"{stem}-{n}.json"
        n += 1
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    return path


@dataclass(frozen=True)
class Source:
    """What SOURCE names, found from paths alone (before the slow task index and model load)."""

    spec: str
    results_dir: Path  # where its results file goes
    step: Optional[int]  # the checkpoint's step (None for hf:DIR)


def resolve_source(source: str, out: str = "", adapter: str = "") -> Source:
    """hf:DIR (a directory with config.json), a run directory or a checkpoint directory; anything else
    is one line. Results go to `out` when given, else RUN/eval for a run or checkpoint, ./eval for hf:DIR."""
    if adapter and not Path(adapter).expanduser().is_dir():
        raise InputError(f"--adapter {adapter}: no such directory; give a peft adapter directory")
    name = hf_name(source)
    if name is not None:
        path = Path(name).expanduser()
        if not (path / "config.json").is_file():
            raise InputError(
                f"eval {source}: no config.json in '{path}': give hf:DIR of a Hugging Face model directory"
            )
        return Source(source, Path(out or EVAL_DIR), None)
    from dtlaunch.run.checkpoints import resolve_load_path
    from dtlaunch.run.run_dir import RunDir

    path = Path(source).expanduser()
    if not path.is_dir():
        raise InputError(f"eval {source}: not a directory: give a run directory, a checkpoint directory or hf:DIR")
    try:
        info, _ = resolve_load_path(path)
    except ConfigError as exc:
        raise InputError(f"eval {source}: not a run, checkpoint or hf:DIR ({exc})") from None
    run = RunDir.of_checkpoint(info.path)
    return Source(source, Path(out) if out else (run.path if run else path) / EVAL_DIR, info.step)


def evaluate_source(src: Source, req: EvalRequest, manager: Any, adapter: str = "") -> tuple[dict, Path]:
    """Load SOURCE on one device (a GPU when there is one), evaluate, write the results file."""
    import torch

    from dtlaunch.data.tokenizer import ByteTokenizer
    from dtlaunch.infer.lm_eval_adapter import load_lm
    from dtlaunch.run.phases import phase

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    start = time.perf_counter()
    lm = load_lm(src.spec, device, req.batch_size, adapter=adapter)
    if req.apply_chat_template and isinstance(lm.loaded.tokenizer, ByteTokenizer):
        raise ConfigError(f"--apply-chat-template: {src.spec} {BYTE_NO_CHAT}: drop --apply-chat-template")
    phase(f"eval: loaded {src.spec} on {device}; running {', '.join(req.tasks)}")
    try:
        out = evaluate(lm, req, manager)
    except ConnectionError as exc:  # online mode without a network: a hub dataset could not be fetched
        raise unreachable_dataset_error(exc, manager, req.tasks) from None
    if lm.hit_max_length:
        phase(
            f"eval: {lm.hit_max_length} of {lm.generations} continuations hit the task's max generation length before "
            f"an end token (ids {sorted({lm.loaded.eos_id, *lm.loaded.stop_ids} - {None})})"
        )
    record = results_record(
        out, req, src.spec + (f" + {adapter}" if adapter else ""), src.step, time.perf_counter() - start
    )
    return record, write_results(record, src.results_dir)
