"""`plan --maximize KEY`: the largest training.seq_len or training.micro_batch that fits, the rest of the
job fixed; for objective=grpo also objective.num_generations (the prompts per step fixed: the global
batch grows with G) and objective.max_completion_length (the prompts' room fixed: training.seq_len grows
with it). A binary search over the analytic planner: each probe sets the value, runs the config's rules
(a value they refuse counts as not fitting) and plans the job; memory grows with either value, so the
values that fit are a prefix of the candidates."""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

from dtlaunch.errors import ConfigError

MAXIMIZABLE = ("training.seq_len", "training.micro_batch")
GRPO_MAXIMIZABLE = ("objective.num_generations", "objective.max_completion_length")
# Without a global batch to divide, micro-batches are searched up to this; completions per prompt too.
MAX_MICRO_BATCH = 1 << 16


@dataclass
class Maximized:
    key: str
    value: Optional[int]  # None: not even the smallest candidate fits
    smallest: int
    largest: int  # the last candidate (model.max_seq_len; the per-rank global batch when it is fixed)
    plan: Any  # the MemoryPlan at `value` (or at the smallest candidate when nothing fits)
    savers: tuple[str, ...] = ()  # overrides of the savers the plan chose itself at `value` (0 = from the plan)
    coupled: tuple[str, ...] = ()  # the values that move with `key` (GRPO: global batch, seq_len)

    @property
    def override(self) -> str:
        return " ".join((f"{self.key}={self.value}", *self.coupled))


def maximize(cfg: Any, key: str) -> Maximized:
    """The largest value of `key` (see MAXIMIZABLE) whose plan fits, by bisection over its candidates. With
    context parallel, both attention styles (strategy.cp_style) are searched and the larger wins; the other
    style, when it wins, is among the savers to paste."""
    best = _maximize(cfg, key)
    if int(cfg.strategy.cp) == 1:
        return best
    from omegaconf import OmegaConf

    from dtlaunch.config.schema import CpStyle

    other = CpStyle.ring if cfg.strategy.cp_style == CpStyle.ulysses else CpStyle.ulysses
    job = copy.deepcopy(cfg)
    OmegaConf.update(job, "strategy.cp_style", str(other))
    alt = _maximize(job, key)
    if alt.value is not None and (best.value is None or alt.value > best.value):
        return dataclasses.replace(alt, savers=(f"strategy.cp_style={other}", *alt.savers))
    return best


def _maximize(cfg: Any, key: str) -> Maximized:
    from dtlaunch.models.registry import model_spec

    grpo = str(cfg.objective.name) == "grpo"
    if key not in MAXIMIZABLE + (GRPO_MAXIMIZABLE if grpo else ()):
        extra = " (objective=grpo: also objective.num_generations, objective.max_completion_length)"
        raise ConfigError(
            f"--maximize {key} is not supported: use --maximize training.seq_len or training.micro_batch{extra}"
        )
    if not model_spec(cfg.model).analytic:
        raise ConfigError(
            f"--maximize needs the analytic planner, but model.arch={cfg.model.arch} is planned by tracing: "
            f"set {key} by hand and run plan"
        )
    value_at, count = _candidates(cfg, key)
    plans: dict[int, Any] = {}

    def fits(i: int) -> bool:
        plans[i] = _plan_with(cfg, key, value_at(i))
        return plans[i] is not None and plans[i].fits

    lo, hi = 0, count - 1  # invariant: every index < lo fits, every index > hi does not
    best = -1
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(mid):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    if best < 0:
        return Maximized(key=key, value=None, smallest=value_at(0), largest=value_at(count - 1), plan=plans.get(0))
    value = value_at(best)
    moved = _with(cfg, key, value)
    return Maximized(
        key=key,
        value=value,
        smallest=value_at(0),
        largest=value_at(count - 1),
        plan=plans[best],
        savers=planned_savers(cfg, key, value),
        coupled=tuple(f"{k}={v}" for k, v in moved.items() if k != key),
    )


def _with(cfg: Any, key: str, value: int) -> dict[str, int]:
    """The overrides that set `key` to `value`: for GRPO the prompts per step, or the prompts' room in
    training.seq_len, stay as they are."""
    from dtlaunch.config.layout import Layout, global_batch, world_size

    o, t = cfg.objective, cfg.training
    if key == "objective.num_generations":
        prompts = global_batch(cfg, Layout.resolve(cfg.strategy, world_size(cfg))) // int(o.num_generations)
        return {key: value, "training.global_batch": prompts * value}
    if key == "objective.max_completion_length":
        return {key: value, "training.seq_len": int(t.seq_len) - int(o.max_completion_length) + value}
    return {key: value}


def planned_savers(cfg: Any, key: str, value: int) -> tuple[str, ...]:
    """The savers left to the plan (training.mlp_tiles=0, training.activation_offload unset) that it turns on
    at `key`=`value`, as overrides."""
    from omegaconf import OmegaConf

    from dtlaunch.config.layout import Layout, activation_offload, mlp_tiles, world_size

    job = copy.deepcopy(cfg)
    for k, v in _with(cfg, key, value).items():
        OmegaConf.update(job, k, v)
    layout = Layout.resolve(job.strategy, world_size(job))
    out = []
    if not int(cfg.training.mlp_tiles):
        tiles = mlp_tiles(job, layout)
        out += [f"training.mlp_tiles={tiles}"] if tiles > 1 else []
    if cfg.training.activation_offload is None and activation_offload(job, layout.pp):
        out.append("training.activation_offload=true")
    return tuple(out)


def _candidates(cfg: Any, key: str) -> tuple[Callable[[int], int], int]:
    """(index -> value, number of candidates), ascending."""
    from dtlaunch.config.layout import Layout, global_batch, world_size

    s, t = cfg.strategy, cfg.training
    lay = Layout.resolve(s, world_size(cfg))
    if key == "objective.max_completion_length":
        prompt_room = int(t.seq_len) - int(cfg.objective.max_completion_length)
        return (lambda i: i + 1), int(cfg.model.max_seq_len) - prompt_room
    if key == "objective.num_generations":
        # Whole micro-batches on every rank: G x prompts / dp a multiple of the micro-batch.
        prompts = global_batch(cfg, lay) // int(cfg.objective.num_generations)
        g_values = [g for g in range(2, MAX_MICRO_BATCH + 1) if (prompts * g // lay.dp) % int(t.micro_batch) == 0]
        return (lambda i: g_values[i]), len(g_values)
    if key == "training.seq_len":
        # Sequence parallel splits the sequence over TP ranks, context parallel into 2·cp chunks.
        step = math.lcm(lay.tp if s.sequence_parallel and lay.tp > 1 else 1, 2 * lay.cp if lay.cp > 1 else 1)
        return (lambda i: (i + 1) * step), int(cfg.model.max_seq_len) // step
    # Micro-batches: divisors of the per-rank global batch when it is fixed, else every size up to a cap.
    per_rank = int(t.global_batch) // lay.dp if int(t.global_batch) else 0
    n_mb = int(s.pp_microbatches) if lay.pp > 1 else 1
    values = [v for v in range(1, (per_rank or MAX_MICRO_BATCH) + 1) if (not per_rank or per_rank % v == 0)]
    values = [v for v in values if v % max(1, n_mb) == 0] or [1]
    return (lambda i: values[i]), len(values)


def _plan_with(cfg: Any, key: str, value: int) -> Any:
    """The job's plan with `key` set to `value`, or None when the config's rules refuse that value."""
    from omegaconf import OmegaConf

    from dtlaunch.config.validate import validate
    from dtlaunch.plan.memory import plan_memory

    job = copy.deepcopy(cfg)
    for k, v in _with(cfg, key, value).items():
        OmegaConf.update(job, k, v)
    try:
        layout = validate(job).layout
    except ConfigError:
        return None
    return plan_memory(job, layout, all_stages=False)
