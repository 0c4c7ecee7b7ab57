"""Experiment trackers besides metrics.jsonl: Weights & Biases (offline by default) and MLflow.

Global rank 0 only (the MetricsLogger owns them). Each gets the resolved config as parameters, the run
directory's name as the run name, every metrics line as it is flushed (every training.log_every steps,
never per step on the hot path) and the end-of-run summary. A resumed run continues the same tracker
run: its id is kept in <run dir>/trackers.json. Packages are imported here only, when asked for;
validation has already refused a tracker whose package is missing.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

IDS_FILE = "trackers.json"
_SKIPPED = {"step", "time"}


def _numeric(rec: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in rec.items()
        if k not in _SKIPPED and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def flatten(tree: Any, prefix: str = "") -> dict[str, str]:
    """Nested config -> {"model.dim": "128", ...} (lists as JSON), the form trackers take as parameters."""
    if isinstance(tree, dict):
        out: dict[str, str] = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: json.dumps(tree) if isinstance(tree, (list, dict)) else str(tree)}


class _Ids:
    """Tracker run ids kept in the run directory, so a resume logs into the same tracker run."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / IDS_FILE
        self.ids: dict[str, str] = json.loads(self.path.read_text()) if self.path.is_file() else {}

    def get(self, name: str) -> Optional[str]:
        return self.ids.get(name)

    def set(self, name: str, value: str) -> None:
        self.ids[name] = value
        self.path.write_text(json.dumps(self.ids, indent=1) + "\n")


class WandbTracker:
    def __init__(self, run_dir: Path, cfg: JobConfig, config: dict[str, Any], ids: _Ids) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE") or str(cfg.logging.wandb.mode)
        run_id = ids.get("wandb") or uuid.uuid4().hex[:8]
        ids.set("wandb", run_id)
        self.run = wandb.init(
            project=str(cfg.logging.wandb.project),
            entity=str(cfg.logging.wandb.entity) or None,
            name=run_dir.name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            config=config,
            mode=mode,
            settings=wandb.Settings(silent=True, console="off"),
        )

    def log(self, step: int, rec: dict[str, Any]) -> None:
        self.run.log(_numeric(rec), step=step)

    def finish(self, summary: Optional[dict[str, Any]]) -> None:
        if summary:
            self.run.summary.update({k: v for k, v in summary.items() if v is not None})
        self.run.finish()


class MlflowTracker:
    def __init__(self, run_dir: Path, cfg: JobConfig, config: dict[str, Any], ids: _Ids) -> None:
        from mlflow.tracking import MlflowClient

        local = (run_dir / "mlruns").resolve()
        uri = str(cfg.logging.mlflow.tracking_uri)
        if not uri:
            # MLflow 3 refuses new plain-file stores: a local store is an SQLite file inside mlruns/.
            local.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{local / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=uri)
        run_id = ids.get("mlflow")
        if run_id is None:
            name = str(cfg.logging.mlflow.experiment)
            exp = self.client.get_experiment_by_name(name)
            artifacts = None if cfg.logging.mlflow.tracking_uri else (local / "artifacts").as_uri()
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name, artifacts)
            run_id = self.client.create_run(exp_id, run_name=run_dir.name).info.run_id
            ids.set("mlflow", run_id)
            self._log_params(run_id, flatten(config))
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def _log_params(self, run_id: str, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 parameters per batch
            self.client.log_batch(run_id, params=items[i : i + 100])

    def log(self, step: int, rec: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        metrics = [Metric(k, v, ts, step) for k, v in _numeric(rec).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, summary: Optional[dict[str, Any]]) -> None:
        if summary:
            for k, v in summary.items():
                if v is not None:
                    self.client.set_tag(self.run_id, f"summary.{k}", json.dumps(v))
        self.client.set_terminated(self.run_id, status="FINISHED" if summary else "KILLED")


class Trackers:
    """The configured trackers other than TensorBoard (which MetricsLogger writes itself)."""

    def __init__(self, run_dir: Path, cfg: JobConfig) -> None:
        from omegaconf import OmegaConf

        names = [str(t) for t in cfg.logging.trackers]
        self.items: list[Any] = []
        if not any(n in ("wandb", "mlflow") for n in names):
            return
        config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        ids = _Ids(run_dir)
        if "wandb" in names:
            self.items.append(WandbTracker(run_dir, cfg, config, ids))  # type: ignore[arg-type]
        if "mlflow" in names:
            self.items.append(MlflowTracker(run_dir, cfg, config, ids))  # type: ignore[arg-type]

    def log(self, step: int, rec: dict[str, Any]) -> None:
        for t in self.items:
            t.log(step, rec)

    def finish(self, summary: Optional[dict[str, Any]]) -> None:
        items, self.items = self.items, []
        for t in items:
            t.finish(summary)
