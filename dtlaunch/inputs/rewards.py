"""Reward functions named in objective.rewards: found, imported and tried once before any worker starts.

A name is a built-in (`accuracy`, `format`: dtlaunch.inputs.builtin_rewards), `module:function` (imported
from sys.path) or `path/to/file.py:function`. Every function has TRL's signature, so one written for
TRL's GRPOTrainer works unchanged:

    f(prompts=[...], completions=[...], completion_ids=[[...], ...], **dataset_columns) -> list[float | None]

None means "does not apply to this completion" (TRL: excluded from that function's mean; a completion no
function scores gets advantage 0). `dtlaunch.inputs.tools.check_rewards` calls each function on a sample record and refuses,
in one line naming the function and the record, one that cannot be imported, raises, returns the wrong
count, NaN or a non-number.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from dtlaunch.errors import InputError
from dtlaunch.inputs.builtin_rewards import accuracy_reward, format_reward

if TYPE_CHECKING:
    from dtlaunch.config.schema import ObjectiveConfig

RewardFn = Callable[..., list]


@dataclass(frozen=True)
class Reward:
    name: str  # as objective.rewards names it (the metrics' rewards/<name>/mean)
    fn: RewardFn
    weight: float


def load_reward(spec: str, format_regex: str = "", answer_field: str = "answer") -> RewardFn:
    """The function objective.rewards names (InputError when it cannot be imported)."""
    if spec == "accuracy":
        return lambda **kw: accuracy_reward(answer_field=answer_field, **kw)
    if spec == "format":
        return lambda **kw: format_reward(pattern=format_regex, **kw)
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise InputError(
            f"objective.rewards: '{spec}' is no reward function: use accuracy, format, module:function or "
            f"path/to/file.py:function"
        )
    return import_function(spec, "objective.rewards")


def import_function(spec: str, key: str) -> Callable[..., Any]:
    """The function `module:function` or `path/to/file.py:function` names (InputError naming `key` when it
    cannot be imported): objective.rewards' and objective.tools' user functions."""
    where, _, attr = spec.rpartition(":")
    try:
        if where.endswith(".py"):
            path = Path(where).expanduser()
            if not path.is_file():
                raise InputError(f"{key}: '{spec}': no file {path}: point it at a Python file")
            module_spec = importlib.util.spec_from_file_location(f"dtlaunch_user_{path.stem}", path)
            assert module_spec is not None and module_spec.loader is not None
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except InputError:
        raise
    except Exception as exc:  # the user's module failed to import: one line, its own error named
        raise InputError(f"{key}: '{spec}' cannot be imported ({type(exc).__name__}: {exc})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise InputError(f"{key}: '{spec}': {where} has no function {attr}")
    return fn


BUILTINS = ("accuracy", "format")


def user_rewards(o: ObjectiveConfig) -> list[str]:
    """objective.rewards' user functions (not the built-ins): what runs in the user-code process."""
    return [str(s) for s in o.rewards if str(s) not in BUILTINS]


def load_rewards(o: ObjectiveConfig, elsewhere: Optional[Callable[[str], RewardFn]] = None) -> list[Reward]:
    """objective.rewards with their weights (objective.reward_weights, or 1 each). `elsewhere(spec)`: the
    function standing in for a user function run in another process (not imported here)."""
    weights = [float(w) for w in o.reward_weights] or [1.0] * len(o.rewards)
    out = []
    for s, w in zip(o.rewards, weights, strict=True):
        if elsewhere is not None and str(s) not in BUILTINS:
            out.append(Reward(str(s), elsewhere(str(s)), w))
        else:
            out.append(Reward(str(s), load_reward(str(s), str(o.format_regex), str(o.answer_field)), w))
    return out


def call_reward(
    reward: Reward,
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]],
    columns: dict[str, Sequence[Any]],
    record: str = "",
) -> list[float]:
    """One function's rewards for the completions (NaN for None), every value checked: a reward that
    raises or returns something else than one number (or None) per completion is an InputError."""
    where = f" on {record}" if record else ""
    try:
        out = reward.fn(prompts=list(prompts), completions=list(completions), completion_ids=completion_ids, **columns)
    except InputError:  # already one line naming the function (its run in the user-code process failed)
        raise
    except Exception as exc:
        raise InputError(
            f"objective.rewards: reward function '{reward.name}' raised{where}: {type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(out, (list, tuple)) or len(out) != len(completions):
        got = f"{len(out)} values" if isinstance(out, (list, tuple)) else type(out).__name__
        raise InputError(
            f"objective.rewards: reward function '{reward.name}' returned {got} for {len(completions)} "
            f"completions{where}: return a list with one float (or None) per completion"
        )
    values = []
    for v in out:
        if v is None:
            values.append(math.nan)
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) and not hasattr(v, "__float__"):
            raise InputError(
                f"objective.rewards: reward function '{reward.name}' returned {v!r} ({type(v).__name__}){where}: "
                f"return floats (or None)"
            )
        f = float(v)
        if not math.isfinite(f):
            raise InputError(
                f"objective.rewards: reward function '{reward.name}' returned {f}{where}: "
                f"return finite floats (or None)"
            )
        values.append(f)
    return values
