"""`objective.reference=RUN_DIR` (or one of its step-XXXXXXXX checkpoints): DPO's reference read from a
dtlaunch run, checked before any worker starts (torch-free).

The checkpoint is the one `dtlaunch ckpt export RUN` and `dtlaunch eval RUN` read (the newest complete one,
dtlaunch.run.checkpoints.resolve_load_path); its architecture is the model section of its completion marker,
the section the weights are loaded with (dtlaunch.convert.hf.load_checkpoint_model), and must be the one
trained here: the reference's log-probs are compared token by token with the policy's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dtlaunch.errors import ConfigError, DtlaunchError

FORMS = "base, hf:DIR, a run directory or one of its checkpoints (RUN/checkpoints/step-XXXXXXXX)"


def reference_checkpoint(ref: str, model: Any) -> Any:
    """The CheckpointInfo of objective.reference=RUN_DIR, after checking it holds a complete checkpoint, a
    readable config.yaml (when the run directory has one) and the architecture of `model`."""
    from dtlaunch.run.checkpoints import resolve_load_path

    where = f"objective.reference='{ref}'"
    path = Path(ref).expanduser()
    if not path.is_dir():
        raise ConfigError(f"{where}: no such directory: give {FORMS}")
    try:
        info, _ = resolve_load_path(path)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    _check_run_config(info.path, where)
    check_same_architecture(_marker_model(info, where), model, where)
    return info


def _check_run_config(checkpoint: Path, where: str) -> None:
    """The run's config.yaml (RUN or RUN/checkpoints/step-N's run) must read back as a job: a corrupt one
    says the directory is not the run it seems to be."""
    from dtlaunch.job.compose import load_resolved
    from dtlaunch.run.run_dir import RunDir

    run = RunDir.of_checkpoint(checkpoint)
    if run is not None and run.config.is_file():
        try:
            load_resolved(run.config)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}: restore the run's config.yaml or give another run") from None


def _marker_model(info: Any, where: str) -> Any:
    from dtlaunch.job.model_schema import model_config_from_marker

    try:
        return model_config_from_marker(info.marker)
    except DtlaunchError as exc:
        raise ConfigError(f"{where}: {info.path}: {exc}") from None


def check_same_architecture(theirs: Any, ours: Any, where: str) -> None:
    """Every field that describes the weights (not the TRAINING_CHOICE ones: name, max_seq_len,
    init_from) equal in the reference's model section and the trained one's."""
    from dtlaunch.config.schema import to_dict
    from dtlaunch.job.hf_model import training_choices
    from dtlaunch.job.model_schema import family_schema

    a, b = _flat(to_dict(theirs)), _flat(to_dict(ours))
    free = training_choices(family_schema(to_dict(ours)))
    for key in sorted((a.keys() | b.keys()) - free):
        if a.get(key) != b.get(key):
            raise ConfigError(
                f"{where}: its model has model.{key}={a.get(key)}, the model trained here model.{key}={b.get(key)}: "
                f"give a reference run of the same model (or train model.{key}={a.get(key)})"
            )


def _flat(d: dict, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + str(k)] = v
    return out
