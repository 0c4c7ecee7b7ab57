"""Compose a job: Hydra's compose API over configs/ + recipes + command-line overrides.

`recipe` is a real Hydra config group: the recipe directories (user ones first, then the built-in
`recipes/`) are gathered into one `recipe/` folder of a throwaway search directory, so recipes use
the experiment pattern (`# @package _global_` + `override /model: ...`) and Hydra's own override
grammar (`key=value`, `+key=value`, `~key`, `model=llama3_70b`, lists) applies unchanged.
Every failure becomes a one-line `ConfigError` naming the key and the fix.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
import sysconfig
import tempfile
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from dtlaunch.config.assets import asset_dir
from dtlaunch.errors import ConfigError

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

CONFIGS_DIR = asset_dir("configs")
BUILTIN_RECIPES_DIR = asset_dir("recipes")
RECIPE_PATH_ENV = "DTLAUNCH_RECIPE_PATH"


@dataclass
class Composed:
    """A composed, type-checked job and where it came from."""

    cfg: JobConfig  # omegaconf.DictConfig typed by JobConfig
    choices: dict[str, str]  # group -> chosen option, e.g. {"model": "llama3_8b", "recipe": ...}
    overrides: list[str]
    unresolved: Any = None  # the job as Hydra composed it, interpolations (e.g. ${stdlib:}) not yet resolved

    @property
    def unresolved_yaml(self) -> str:
        """Written only by `dtlaunch config` (without --resolve): YAML dumping is a quarter of a compose."""
        from omegaconf import OmegaConf

        return OmegaConf.to_yaml(self.unresolved) if self.unresolved is not None else ""


def recipe_dirs(extra: Sequence[str] = ()) -> list[Path]:
    """Recipe directories in priority order: --recipe-dir flags, $DTLAUNCH_RECIPE_PATH, built-ins."""
    dirs = [Path(d) for d in extra]
    env = os.environ.get(RECIPE_PATH_ENV, "")
    dirs += [Path(d) for d in env.split(os.pathsep) if d]
    dirs.append(BUILTIN_RECIPES_DIR)
    for d in dirs[:-1]:
        if not d.is_dir():
            raise ConfigError(f"recipe directory '{d}' does not exist: fix --recipe-dir or ${RECIPE_PATH_ENV}")
    return dirs


def list_recipes(extra_dirs: Sequence[str] = ()) -> dict[str, Path]:
    """name -> file for every recipe; an earlier directory shadows a later one."""
    found: dict[str, Path] = {}
    for d in recipe_dirs(extra_dirs):
        for f in sorted(d.glob("*.yaml")):
            found.setdefault(f.stem, f)
    return found


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS_DIR / group).glob("*.yaml"))


def _register_resolvers() -> None:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("stdlib"):
        # The Python standard library's source: a real text corpus present on every machine.
        OmegaConf.register_new_resolver("stdlib", lambda: sysconfig.get_paths()["stdlib"])


def _split_recipe(overrides: Sequence[str], recipes: dict[str, Path]) -> tuple[list[str], Optional[Path], str]:
    """Find `recipe=NAME|PATH` in the overrides; a path becomes a file we link into the search dir."""
    rest: list[str] = []
    recipe_file: Optional[Path] = None
    recipe_name = ""
    for ov in overrides:
        m = re.fullmatch(r"\+?recipe=(.*)", ov)
        if not m:
            rest.append(ov)
            continue
        value = m.group(1).strip()
        as_path = Path(value).expanduser()
        if value.endswith((".yaml", ".yml")) or os.sep in value:
            if not as_path.is_file():
                raise ConfigError(f"recipe file '{value}' not found: give an existing .yaml path or a recipe name")
            recipe_file, recipe_name = as_path.resolve(), as_path.stem
        elif value in recipes:
            recipe_file, recipe_name = recipes[value], value
        else:
            hint = did_you_mean(value, recipes)
            raise ConfigError(f"unknown recipe '{value}'{hint}: see `dtlaunch recipes` for the list")
    if recipe_file is not None:
        from dtlaunch.config.yaml_check import check_yaml_file

        check_yaml_file(recipe_file)
    return rest, recipe_file, recipe_name


# Hydra's runtime settings have no effect here (dtlaunch composes with Hydra's compose API and runs the
# job itself): each gets the dtlaunch setting that does the same job instead of being silently ignored.
_HYDRA_EQUIVALENTS = {
    "hydra.run.dir": "use run.dir=DIR",
    "hydra.sweep.dir": "use run.dir=DIR with -m (the sweep directory)",
    "hydra.sweep.subdir": "each sweep point runs in <sweep dir>/<index>",
    "hydra.job.name": "use run.name=NAME",
    "hydra.job.chdir": "dtlaunch never changes directory",
    "hydra.verbose": "use --debug (or DTLAUNCH_DEBUG=1)",
    "hydra.job_logging": "each rank logs to RUN/logs/rank<N>.log",
    "hydra.launcher": "use -m (points run one after another) or `dtlaunch submit -m ... cluster=slurm` (a job array)",
    "hydra.sweeper": "use -m with Hydra's sweep syntax (a,b / range() / choice())",
}


def refuse_hydra_overrides(overrides: Sequence[str]) -> None:
    """`hydra.*` and `hydra/<group>=` overrides: a one-line error naming dtlaunch's equivalent."""
    for ov in overrides:
        key = ov.lstrip("+~").split("=", 1)[0].replace("/", ".")
        if key != "hydra" and not key.startswith("hydra."):
            continue
        hint = next(
            (v for k, v in _HYDRA_EQUIVALENTS.items() if key == k or key.startswith(k + ".")),
            "remove it (see `dtlaunch config` for the settings there are)",
        )
        raise ConfigError(f"'{ov}' is a Hydra runtime setting, which dtlaunch does not read: {hint}")


def _optional_sections() -> frozenset[str]:
    """Dotted keys of schema fields typed Optional[<dataclass>] (e.g. model.rope_scaling)."""
    return _optional_sections_of(_job_schema())


@functools.cache
def _optional_sections_of(schema: type) -> frozenset[str]:
    """Per job schema (it changes only when a family is loaded): walking its type hints was ~5 ms a compose."""
    import typing

    found: set[str] = set()

    def walk(node: type, prefix: str) -> None:
        for name, hint in typing.get_type_hints(node).items():
            args = getattr(hint, "__args__", ())
            inner = next((a for a in args if is_dataclass(a)), None)
            if inner is not None and type(None) in args:
                found.add(prefix + name)
            elif is_dataclass(hint):
                walk(hint, f"{prefix}{name}.")

    walk(schema, "")
    return frozenset(found)


def _split_optional_section_overrides(overrides: list[str]) -> tuple[list[str], list[tuple[str, Any]]]:
    """OmegaConf cannot assign into an Optional[dataclass] field that is null (model.rope_scaling on a
    Llama-2 model), so `section=...` and `section.field=...` for such fields are applied by us after
    composition, onto the composed dict, keeping command-line precedence."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    sections = _optional_sections()
    kept: list[str] = []
    deferred: list[tuple[str, Any]] = []
    for ov in overrides:
        key = ov.split("=", 1)[0].lstrip("+")
        if "=" in ov and not ov.startswith("~") and any(key == s or key.startswith(s + ".") for s in sections):
            try:
                parsed = OverridesParser.create().parse_overrides([ov])[0]
            except Exception as exc:
                raise ConfigError(explain_compose_error(exc, [ov])) from exc
            deferred.append((parsed.key_or_group, parsed.value()))
        else:
            kept.append(ov)
    return kept, deferred


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    for part in parents:
        if tree.get(part) is None:
            tree[part] = {}
        tree = tree[part]
    tree[leaf] = value


def _reset_to_default(override: str) -> str:
    """`~section.key` means "back to the schema default": structured configs cannot delete fields,
    and the schema is the one home of defaults, so rewrite it as an assignment of that default."""
    m = re.fullmatch(r"~([A-Za-z_][\w]*\.[\w.]+)(=.*)?", override)
    if not m:
        return override
    from omegaconf import OmegaConf

    from dtlaunch.job.model_schema import schema_node

    key = m.group(1)
    schema = schema_node(_job_schema())
    try:
        default = OmegaConf.select(schema, key, throw_on_missing=False, default=KeyError)
    except Exception:
        default = KeyError
    if default is KeyError:
        raise ConfigError(_unknown_key_message(key).replace("unknown key", "cannot reset unknown key", 1))
    if OmegaConf.is_config(default):
        default = OmegaConf.to_container(default)
    import json

    return f"{key}={'null' if default is None else json.dumps(default)}"


def _build_search_dir(tmp: Path, recipe_file: Optional[Path], recipe_name: str) -> None:
    """configs/* plus a recipe/ group holding the chosen recipe, as symlinks (no copies)."""
    for entry in CONFIGS_DIR.iterdir():
        (tmp / entry.name).symlink_to(entry)
    (tmp / "recipe").mkdir()
    if recipe_file is not None:
        (tmp / "recipe" / f"{recipe_name}.yaml").symlink_to(recipe_file)


def _compose_without_hydra_node(overrides: list[str]) -> tuple[Any, dict]:
    """`hydra.compose(config_name="job", overrides=...)` (the job, Hydra's override grammar and errors, command-line
    overrides applied in struct mode), less the `hydra` node that compose builds and we deleted: Hydra's own
    settings (logging, launcher, sweeper, help, ...) and half of its config files: the Hydra step takes 58 ms
    instead of 125 (bench/compose_time.py; the test suite composes thousands of jobs). The same steps as Hydra 1.3's
    ConfigLoaderImpl._load_configuration_impl with prepend_hydra=False; the group choices come from the defaults
    list, where compose copies them into hydra.runtime.choices. tests/unit/test_compose_hydra.py holds the result
    equal to hydra.compose's on every recipe."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.config_repository import CachingConfigRepository
    from hydra._internal.defaults_list import create_defaults_list
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    loader = GlobalHydra.instance().config_loader()
    parsed = OverridesParser.create().parse_overrides(overrides=overrides)
    # Hydra deep-copies its repository into the caching one (with the ConfigStore's every node: ~35 ms) lest
    # initialize_sources change it; ours is built for this one compose and thrown away after.
    repo = CachingConfigRepository.__new__(CachingConfigRepository)
    repo.delegate, repo.cache = loader.repository, {}
    loader._process_config_searchpath("job", parsed, repo)
    loader.validate_sweep_overrides_legal(overrides=parsed, run_mode=RunMode.RUN, from_shell=False)
    defaults = create_defaults_list(
        repo=repo, config_name="job", overrides_list=parsed, prepend_hydra=False, skip_missing=False
    )
    cfg = loader._compose_config_from_defaults_list(defaults=defaults.defaults, repo=repo)
    OmegaConf.set_struct(cfg, True)  # as Hydra: a command-line key the job lacks needs `+`
    ConfigLoaderImpl._apply_overrides_to_config(defaults.config_overrides, cfg)
    return cfg, dict(defaults.overrides.known_choices)


def compose(
    overrides: Sequence[str] = (),
    recipe_dirs_extra: Sequence[str] = (),
) -> Composed:
    """Compose and type-check a job. Raises ConfigError with a one-line message on any mistake."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from dtlaunch.job.model_schema import register_schemas, typed_job

    _register_resolvers()
    refuse_hydra_overrides(overrides)
    recipes = list_recipes(recipe_dirs_extra)
    rest, recipe_file, recipe_name = _split_recipe(list(overrides), recipes)
    _load_named_families(rest, recipe_file)
    register_schemas()
    rest, deferred = _split_optional_section_overrides(rest)
    hydra_overrides = [_reset_to_default(ov) for ov in rest]
    if recipe_file is not None:
        hydra_overrides.append(f"recipe={recipe_name}")

    with tempfile.TemporaryDirectory(prefix="dtlaunch-compose-") as tmp:
        _build_search_dir(Path(tmp), recipe_file, recipe_name)
        GlobalHydra.instance().clear()
        try:
            with initialize_config_dir(config_dir=tmp, version_base="1.3", job_name="dtlaunch"):
                cfg, known_choices = _compose_without_hydra_node(hydra_overrides)
        except Exception as exc:  # Hydra and OmegaConf raise many types; all are user input here.
            raise ConfigError(explain_compose_error(exc, rest)) from exc
        finally:
            GlobalHydra.instance().clear()

        choices = {k: str(v) for k, v in known_choices.items() if v is not None and not k.startswith("hydra")}
        if recipe_name:
            cfg.recipe = recipe_name
            choices["recipe"] = recipe_name
        try:
            # Resolve interpolations once here: workers read the resolved file, never re-resolve.
            resolved = OmegaConf.to_container(cfg, resolve=True)
        except Exception as exc:
            raise ConfigError(explain_compose_error(exc, rest)) from exc
    for key, value in deferred:
        _set_dotted(resolved, key, value)
    from dtlaunch.job.hf_model import apply_hf_model

    apply_hf_model(resolved, rest)
    try:
        # `+key=value` passes Hydra (it opens the node) but the schema is closed: merging says so.
        # A deleted key (`~key`) falls back to its schema default. The model section is typed by its
        # family's own schema now that its arch is known.
        typed = typed_job(resolved)
        # A deferred override (an optional section's field) may hold an interpolation: resolved and
        # type-checked here, not at its first read in some rule (an internal error there).
        OmegaConf.resolve(typed)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(explain_compose_error(exc, rest)) from exc
    missing = sorted(OmegaConf.missing_keys(typed))
    if missing:
        raise ConfigError(f"missing value for '{missing[0]}': set it on the command line, e.g. {missing[0]}=...")
    from dtlaunch.job.tokenizer_choice import resolve_auto_tokenizer

    resolve_auto_tokenizer(typed)
    OmegaConf.set_struct(typed, True)
    return Composed(cfg=typed, choices=choices, overrides=list(overrides), unresolved=cfg)


def load_resolved(path: str | Path) -> JobConfig:
    """Read a resolved config.yaml (as written into a run directory) back into the typed schema."""
    from omegaconf import OmegaConf

    from dtlaunch.config.yaml_check import check_yaml_file

    if Path(path).is_file():
        check_yaml_file(Path(path), "config")
    try:
        return typed_resolved(OmegaConf.load(path))
    except ConfigError:
        raise
    except FileNotFoundError as exc:
        raise ConfigError(f"config file '{path}' not found: is this a dtlaunch run directory?") from exc
    except Exception as exc:
        raise ConfigError(f"config file '{path}' is not a valid job: {_first_line(exc)}") from exc


def typed_resolved(job: Any) -> JobConfig:
    """A resolved job (a config node or the plain container of one) typed by the schema, its model
    section by its family's, with no keys to add."""
    from omegaconf import OmegaConf

    from dtlaunch.job.model_schema import typed_job

    typed = typed_job(job)
    OmegaConf.set_struct(typed, True)
    return typed


def _job_schema() -> type:
    """The job's schema before its model family is known (the model section: every family's fields)."""
    from dtlaunch.job.model_schema import job_schema

    return job_schema()


def _load_named_families(overrides: Sequence[str], recipe_file: Optional[Path]) -> None:
    """Import the family packages a job names (`model.family_module`, on the command line or in its
    recipe) before composing, so that their own model fields are part of the schema Hydra checks."""
    from dtlaunch.models.registry import load_family

    named = [m.group(1) for ov in overrides if (m := re.fullmatch(r"\+{0,2}model\.family_module=(.+)", ov))]
    if recipe_file is not None:
        from omegaconf import OmegaConf

        try:
            named.append(str(OmegaConf.select(OmegaConf.load(recipe_file), "model.family_module", default="") or ""))
        except Exception:  # the recipe's own errors are reported by Hydra, with their key
            pass
    for module in filter(None, (n.strip().strip("'\"") for n in named)):
        load_family(module)


# ---------------------------------------------------------------------------------------------
# Turning Hydra/OmegaConf exceptions into one line that names the key and the fix.


def _first_line(exc: BaseException) -> str:
    """The message's first line; a line ending in ':' ("... raised while composing config:") is only an
    introduction, so the lines after it are joined on until one states the cause (never half a sentence)."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    text = lines[0]
    for line in lines[1:]:
        if not text.endswith(":"):
            break
        if line.startswith(("full_key:", "object_type=", "reference_type=")):
            continue
        text += " " + line
    return text.rstrip(":")


def _schema_fields(dotted_parent: str) -> list[str]:
    """Field names of the schema node at `dotted_parent` ('' = the job root)."""
    import typing

    from dtlaunch.config.schema import section_type

    node: Any = _job_schema()
    for part in [p for p in dotted_parent.split(".") if p]:
        hint = typing.get_type_hints(node).get(part)
        node = section_type(hint)  # Optional[X] and plain X alike
        if node is None:
            return []
    return [f.name for f in fields(node)]


def did_you_mean(word: str, options: Any) -> str:
    """The hint ` (did you mean 'X'?)` naming the closest of `options`, or "" when none is close."""
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _unknown_key_message(full_key: str) -> str:
    parent, _, leaf = full_key.rpartition(".")
    options = _schema_fields(parent)
    if not options and parent:
        return f"unknown config section '{parent}': valid sections are {', '.join(_schema_fields(''))}"
    hint = did_you_mean(leaf, options)
    where = f"'{parent}'" if parent else "the job"
    return f"unknown key '{full_key}'{hint}: {where} has no such field; see `dtlaunch config` for valid keys"


def explain_compose_error(exc: BaseException, overrides: Sequence[str]) -> str:
    """One line: what is wrong, with which key or value, and how to fix it."""
    chain: list[BaseException] = []
    link: BaseException | None = exc
    while link is not None and link not in chain:
        chain.append(link)
        link = link.__cause__ or link.__context__
    full = "\n".join(str(e) for e in chain)

    m = re.search(r"Could not find '([^']+)/([^']+)'", full)
    if m:
        group, option = m.group(1), m.group(2)
        if group == "recipe":
            return f"unknown recipe '{option}': see `dtlaunch recipes` for the list"
        opts = group_options(group)
        return (
            f"unknown option '{option}' for config group '{group}'{did_you_mean(option, opts)}: "
            f"choose one of {', '.join(opts)}"
        )
    m = re.search(r"Could not (?:override|append to|delete) '([^']+)'", full)
    key_m = re.search(r"full_key: ([\w.\[\]]+)", full)
    if m or ("not in struct" in full or "Key '" in full and "not in" in full):
        key = key_m.group(1) if key_m else (m.group(1) if m else "")
        if key:
            if "Could not delete" in full:
                return f"cannot delete '{key}': it is not set here; remove the '~{key}' override"
            if "not in struct" in full or "Key '" in full:
                return _unknown_key_message(key)
    # OmegaConf words a bad boolean differently from a bad number.
    m = re.search(r"Value '(.*?)' (?:of type '\w+' )?could not be converted to (\w+)", full) or re.search(
        r"Value '(.*?)' is not a valid (bool)", full
    )
    if m:
        key = key_m.group(1) if key_m else "?"
        expected = {
            "Integer": "an integer",
            "Float": "a number",
            "Boolean": "true or false",
            "bool": "true or false",
        }.get(m.group(2), m.group(2))
        return f"wrong type for '{key}': got '{m.group(1)}', expected {expected}; fix: {key}=<{expected}>"
    # A schema choice (an Enum field) given a value outside it.
    m = re.search(r"Invalid value '(.*?)', expected one of \[(.*?)\]", full)
    if m:
        key = key_m.group(1) if key_m else "?"
        return f"{key}='{m.group(1)}' is unknown: use one of {m.group(2)}"
    if "Invalid type assigned" in full or "Incompatible value" in full:
        key = key_m.group(1) if key_m else "?"
        return f"wrong type for '{key}': {_first_line(exc)}; fix the value (see `dtlaunch config`)"
    if "Missing mandatory value" in full or "MissingMandatoryValue" in type(exc).__name__:
        key = key_m.group(1) if key_m else "?"
        return f"missing value for '{key}': set it, e.g. {key}=..."
    if type(exc).__name__ in ("OverrideParseException", "LexerNoViableAltException") or "mismatched input" in full:
        return f"cannot parse the overrides {list(overrides)}: {_first_line(exc)}; use key=value"
    m = re.search(r"Could not delete from config. '([^']+)' does not exist", full)
    if m:
        return f"cannot delete '{m.group(1)}': it is not set; remove the '~{m.group(1)}' override"
    m = re.search(r"Ambiguous value for argument '([^']+)'", full)
    if m:
        return f"'{m.group(1)}' is a sweep: add -m (--multirun) to run one job per value, or quote the value"
    if "Multiple values for" in full:
        return f"{_first_line(exc)}: give each group once"
    return f"invalid configuration: {_first_line(exc)}"
