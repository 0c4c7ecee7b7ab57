"""Which schema types a model section: its family's own, or every family's at once.

`ModelConfig` (config/schema.py) holds the fields all families share. A family adds its own by
subclassing it in its folder and naming the subclass in its registry entry (`ModelSpec.config`):
models/dense/config.py, models/moe/config.py, or a package of the user's (`model.family_module`).

- A composed job's model section is typed by its family's class: `cfg.model` has exactly that family's
  fields. A field of another family is dropped while it holds its default (it means nothing here) and
  is an error naming it otherwise.
- Until the family is known (Hydra merging YAML groups and overrides, `~key` resets, shell completion,
  the range table), the union of every registered family's fields types `model`, so a typo is still an
  unknown key and a wrong type still a wrong type.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, Optional

from dtlaunch.config.schema import JobConfig, ModelConfig
from dtlaunch.errors import ConfigError, InputError


def family_schema(model: Any) -> type:
    """The ModelConfig subclass of the family a model section (dict, DictConfig or namespace) belongs to."""
    from dtlaunch.models.registry import model_spec

    return model_spec(model).config


def union_schema() -> type:
    """ModelConfig with every registered family's own fields (the schema before the family is known)."""
    from dtlaunch.models.registry import registry

    classes = {spec.config for spec in registry().values()}
    return _union(tuple(sorted(classes, key=lambda c: (c.__module__, c.__qualname__))))


@functools.cache
def _union(classes: tuple[type, ...]) -> type:
    shared = {f.name for f in dataclasses.fields(ModelConfig)}
    extra: dict[str, tuple[Any, dataclasses.Field, type]] = {}
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, ModelConfig) and dataclasses.is_dataclass(cls)):
            raise ConfigError(f"model family schema {cls!r} is not a dataclass subclassing ModelConfig: fix its entry")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in shared:
                continue
            seen = extra.get(f.name)
            if seen is not None and seen[0] != hints[f.name]:
                raise ConfigError(
                    f"model.{f.name} is typed {seen[0]} by {seen[2].__qualname__} but {hints[f.name]} by "
                    f"{cls.__qualname__}: two families cannot give one field two types; rename one"
                )
            extra.setdefault(f.name, (hints[f.name], f, cls))
    fields = [(name, typ, _same_default(f)) for name, (typ, f, _) in extra.items()]
    union = dataclasses.make_dataclass("ModelConfig", fields, bases=(ModelConfig,))
    union.__module__ = __name__
    return union


def _same_default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=f.default_factory, metadata=f.metadata)
    return dataclasses.field(default=f.default, metadata=f.metadata)


@functools.cache
def _job(model_cls: type) -> type:
    if model_cls is ModelConfig:
        return JobConfig
    model = dataclasses.field(default_factory=model_cls)
    job = dataclasses.make_dataclass("JobConfig", [("model", model_cls, model)], bases=(JobConfig,))
    job.__module__ = __name__
    return job


def job_schema(model_cls: Optional[type] = None) -> type:
    """JobConfig with `model` typed by `model_cls` (default: the union of every family's fields)."""
    return _job(model_cls or union_schema())


def own_fields(model: dict, cls: type) -> dict:
    """`model` without the fields of other families, each of which must hold its default."""
    own = {f.name for f in dataclasses.fields(cls)}
    union = union_schema()
    foreign = [k for k in model if k not in own and k in {f.name for f in dataclasses.fields(union)}]
    if not foreign:
        return model
    from omegaconf import OmegaConf

    defaults = OmegaConf.to_container(schema_node(union))
    for key in foreign:
        differs = _first_difference(f"model.{key}", model[key], defaults[key])  # type: ignore[index]
        if differs:
            archs = _archs_with(key)
            arch = model.get("arch") or "llama"
            raise ConfigError(
                f"{differs} with model.arch={arch}, whose fields have no model.{key}: remove it"
                + (f", or use model.arch={' / '.join(archs)}" if archs else "")
            )
    return {k: v for k, v in model.items() if k not in foreign}


def _first_difference(key: str, value: Any, default: Any) -> str:
    """'key=value' of the first leaf where `value` departs from `default`; '' where it does not."""
    if isinstance(value, dict) and isinstance(default, dict):
        for k, v in value.items():
            found = _first_difference(f"{key}.{k}", v, default.get(k))
            if found:
                return found
        return ""
    return "" if value == default else f"{key}={value}"


def _archs_with(key: str) -> list[str]:
    from dtlaunch.models.registry import registry

    return sorted(a for a, s in registry().items() if key in {f.name for f in dataclasses.fields(s.config)})


def typed_job(raw: Any) -> Any:
    """The job (a plain dict or config node) merged into JobConfig, its model section typed by its family."""
    from omegaconf import OmegaConf

    job = OmegaConf.to_container(raw) if OmegaConf.is_config(raw) else dict(raw)
    model = dict(job.get("model") or {})  # type: ignore[union-attr]
    cls = family_schema(model)
    job["model"] = own_fields(model, cls)  # type: ignore[index]
    return OmegaConf.merge(schema_node(_job(cls)), job)


def typed_model(raw: Any) -> Any:
    """One model section (a plain dict or config node) typed by its family's schema."""
    from omegaconf import OmegaConf

    model = OmegaConf.to_container(raw) if OmegaConf.is_config(raw) else dict(raw)
    cls = family_schema(model)
    return OmegaConf.merge(schema_node(cls), own_fields(model, cls))  # type: ignore[arg-type]


def model_config_from_marker(marker: dict) -> Any:
    """The typed model section a checkpoint was written with (stored in its completion marker)."""
    if "model" not in marker:
        raise InputError("checkpoint marker has no model section: it was not written by dtlaunch's CheckpointManager")
    try:
        return typed_model(marker["model"])
    except Exception as exc:  # noqa: BLE001 - OmegaConf's many error types; the marker is a file we read
        first = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        raise InputError(f"checkpoint marker's model section is not a model ({first}): restore the marker") from None


@functools.cache
def schema_node(cls: type) -> Any:
    """OmegaConf.structured(cls), built once per schema class: a job is composed and typed several times
    per command and per test, and building the node from the dataclasses is a third of the cost. Read it
    (select, to_container) or pass it first to OmegaConf.merge, which copies it; never change it."""
    from omegaconf import OmegaConf

    return OmegaConf.structured(cls)


_REGISTERED: list[type] = []  # the job schema last stored in Hydra's ConfigStore (a process-wide singleton)


def register_schemas() -> None:
    """Register the job's schema with Hydra's ConfigStore, `model` as the union of the families
    (idempotent: stored again only when a newly loaded family changed the union). configs/job.yaml starts
    from it; the groups' options are the YAML files."""
    from hydra.core.config_store import ConfigStore

    schema = job_schema()
    if _REGISTERED and _REGISTERED[-1] is schema:
        return
    ConfigStore.instance().store(name="job_schema", node=schema_node(schema))
    _REGISTERED.append(schema)
