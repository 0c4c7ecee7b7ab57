"""`plan --maximize KEY`: the largest training.seq_len or training.micro_batch that fits, the rest of the
job fixed but for the memory savers (SAVERS) the user left open; for objective=grpo also
objective.num_generations (the prompts per step fixed: the global batch grows with G) and
objective.max_completion_length (the prompts' room fixed: training.seq_len grows with it). A binary search
over the analytic planner for each combination of savers, cheapest first: each probe sets the value and
the savers, runs the config's rules (a value they refuse counts as not fitting) and plans the job; memory
grows with either value, so the values that fit are a prefix of the candidates."""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Collection, Optional

from dtlaunch.config.decisions import MLP_TILE_TOKENS, Decisions
from dtlaunch.config.schema import ObjectiveName
from dtlaunch.errors import ConfigError

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

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
    # The savers at `value` as overrides: those the search turned on (SAVERS), then those the plan chose itself
    # (training.mlp_tiles=0, training.activation_offload unset), pinned to the plan's choice.
    savers: tuple[str, ...] = ()
    coupled: tuple[str, ...] = ()  # the values that move with `key` (GRPO: global batch, seq_len)

    @property
    def override(self) -> str:
        return " ".join((f"{self.key}={self.value}", *self.coupled))


# training.loss_chunks as a saver: chunks of at most this many tokens of one rank's micro-batch (the tiled
# MLP's tile size), and never fewer chunks than the job's own.
LOSS_CHUNK_TOKENS = MLP_TILE_TOKENS
# (Not training.loss_chunks=0, the job's own auto, config.decisions.Decisions.loss_chunks: this level chunks for memory.)
LOSS_CHUNKS_AUTO = "auto"  # a level resolved at each probed value (the chunk count grows with the tokens)


@dataclass(frozen=True)
class Saver:
    """A switch the search may turn up from the job's own value: `levels(cfg)` are the values beyond the
    job's, least saving (and cheapest) first; none where the job already has the most."""

    key: str
    levels: Callable[[Any], tuple[Any, ...]]
    pinnable: bool = True  # False: searched even when the command line sets it


def _cp_style_levels(cfg: JobConfig) -> tuple[Any, ...]:
    from dtlaunch.config.schema import CpStyle

    if int(cfg.strategy.cp) == 1:
        return ()
    return (str(CpStyle.ring if cfg.strategy.cp_style == CpStyle.ulysses else CpStyle.ulysses),)


def _ac_levels(cfg: JobConfig) -> tuple[Any, ...]:
    order = ("none", "selective", "full")
    return order[order.index(str(cfg.training.activation_checkpointing)) + 1 :]


# The savers, cheapest first. The rule: every combination of levels is a candidate, compared by its most
# expensive saver's level first (then the next most expensive, ...), and the first combination in that order
# that reaches the largest value any of them reaches wins: a saver is on only where every cheaper way falls
# short. Costs, per step (docs/memory.md, docs/long-context.md):
# - the other context-parallel attention style (cp > 1): not a saver but a trade of communication; it wins
#   only where it fits more, and is tried even when the command line names a style (as it always was);
# - more loss chunks (only when the job chunks already: 1 is a choice, e.g. a model without the
#   hidden-states switch): no FLOP where the chunks' gradients are taken in forward, the same one more head
#   matmul per token as any chunk count where they are recomputed; more, smaller matmuls;
# - activation checkpointing, selective then full: recompute in backward (full: one more block forward);
# - activation offload: host RAM and host-link time (hidden behind compute under full checkpointing only);
# - FSDP CPU offload: host RAM, the states' host-link traffic and the optimizer step on the CPU.
# The tiled MLP is the plan's own default (training.mlp_tiles=0) and is not searched. Savers that change what
# is trained are never turned on: a low-bit optimizer (optim.name=adamw8bit / adamw4bit: quantisation error,
# and torchao), bf16 optimizer state, the step in backward (no accumulation or clipping), a bf16 residual
# stream (precision.residual_dtype): set them by hand and maximize again.
SAVERS = (
    Saver("strategy.cp_style", _cp_style_levels, pinnable=False),
    Saver("training.loss_chunks", lambda cfg: (LOSS_CHUNKS_AUTO,) if Decisions.of(cfg).loss_chunks > 1 else ()),
    Saver("training.activation_checkpointing", _ac_levels),
    Saver("training.activation_offload", lambda cfg: () if cfg.training.activation_offload else (True,)),
    Saver("strategy.cpu_offload", lambda cfg: () if cfg.strategy.cpu_offload else (True,)),
)


def maximize(cfg: JobConfig, key: str, pinned: Collection[str] = ()) -> Maximized:
    """The largest value of `key` (see MAXIMIZABLE) whose plan fits, by bisection over its candidates, over
    every combination of the SAVERS not in `pinned` (the keys the user set: the command line's), with the
    cheapest combination that reaches it (see SAVERS). Memory grows with the value under every combination,
    so each combination's values that fit are a prefix of the candidates; a combination the config's rules
    refuse, or whose host RAM overflows, fits nothing."""
    from dtlaunch.models.registry import model_spec

    grpo = cfg.objective.name == ObjectiveName.grpo
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
    free = [(s, s.levels(cfg)) for s in SAVERS if not (s.pinnable and s.key in pinned)]
    free = [(s, levels) for s, levels in free if levels]
    # Level 0 is the job's own value; compared most expensive saver first (the tuple reversed).
    combos = sorted(itertools.product(*(range(len(levels) + 1) for _, levels in free)), key=lambda c: c[::-1])
    job = copy.deepcopy(cfg)  # one copy, every probe sets every searched key
    plans: dict[tuple[tuple[int, ...], int], Any] = {}

    def settings(combo: tuple[int, ...]) -> dict[str, Any]:
        return {s.key: levels[i - 1] for (s, levels), i in zip(free, combo, strict=True) if i}

    def fits(combo: tuple[int, ...], i: int) -> bool:
        if (combo, i) not in plans:
            plans[combo, i] = _plan_with(job, cfg, key, value_at(i), settings(combo))
        p = plans[combo, i]
        return p is not None and p.fits

    # The largest value first, most saving combinations first (the first bisection finds it most of the
    # time; every other combination then costs one probe, one candidate past the best), then the cheapest
    # combination that reaches it.
    best = -1
    for combo in reversed(combos):
        lo = best + 1
        if lo >= count or not fits(combo, lo):
            continue
        best, hi = lo, count - 1
        lo += 1
        while lo <= hi:  # invariant: every index < lo fits, every index > hi does not
            mid = (lo + hi) // 2
            if fits(combo, mid):
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
    if best < 0:
        fits(combos[0], 0)
        return Maximized(
            key=key, value=None, smallest=value_at(0), largest=value_at(count - 1), plan=plans[combos[0], 0]
        )
    winner = next(combo for combo in combos if fits(combo, best))
    value = value_at(best)
    chosen = _resolved(cfg, key, value, settings(winner))
    return Maximized(
        key=key,
        value=value,
        smallest=value_at(0),
        largest=value_at(count - 1),
        plan=plans[winner, best],
        savers=(*(f"{k}={_text(v)}" for k, v in chosen.items()), *planned_savers(cfg, key, value, chosen)),
        coupled=tuple(f"{k}={v}" for k, v in _with(cfg, key, value).items() if k != key),
    )


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _resolved(cfg: JobConfig, key: str, value: int, settings: dict[str, Any]) -> dict[str, Any]:
    """A combination's settings at `key`=`value`: the loss's chunk count from one rank's tokens there (none
    when that is no more than the job's own count)."""
    if settings.get("training.loss_chunks") != LOSS_CHUNKS_AUTO:
        return settings
    t, moved, dec = cfg.training, _with(cfg, key, value), Decisions.of(cfg)
    rows = int(moved.get("training.micro_batch", t.micro_batch)) * dec.rows_per_sample
    seq = int(moved.get("training.seq_len", t.seq_len)) // dec.layout.cp
    chunks = -(-rows * seq // LOSS_CHUNK_TOKENS)
    if chunks > dec.loss_chunks:
        return {**settings, "training.loss_chunks": chunks}  # (the same place: SAVERS' order)
    return {k: v for k, v in settings.items() if k != "training.loss_chunks"}


def _with(cfg: JobConfig, key: str, value: int) -> dict[str, int]:
    """The overrides that set `key` to `value`: for GRPO the prompts per step, or the prompts' room in
    training.seq_len, stay as they are."""
    o, t = cfg.objective, cfg.training
    if key == "objective.num_generations":
        prompts = Decisions.of(cfg).global_batch // int(o.num_generations)
        return {key: value, "training.global_batch": prompts * value}
    if key == "objective.max_completion_length":
        return {key: value, "training.seq_len": int(t.seq_len) - int(o.max_completion_length) + value}
    return {key: value}


def planned_savers(cfg: JobConfig, key: str, value: int, settings: dict[str, Any]) -> tuple[str, ...]:
    """The savers left to the plan (training.mlp_tiles=0, training.activation_offload unset and not among
    `settings`) that it turns on at `key`=`value` with `settings`, as overrides."""
    from omegaconf import OmegaConf

    job = copy.deepcopy(cfg)
    for k, v in {**_with(cfg, key, value), **settings}.items():
        OmegaConf.update(job, k, v)
    dec = Decisions.of(job)
    out = []
    if not int(cfg.training.mlp_tiles):
        out += [f"training.mlp_tiles={dec.mlp_tiles}"] if dec.mlp_tiles > 1 else []
    if job.training.activation_offload is None and dec.activation_offload:
        out.append("training.activation_offload=true")
    return tuple(out)


def _candidates(cfg: JobConfig, key: str) -> tuple[Callable[[int], int], int]:
    """(index -> value, number of candidates), ascending."""
    s, t = cfg.strategy, cfg.training
    dec = Decisions.of(cfg)
    lay = dec.layout
    if key == "objective.max_completion_length":
        prompt_room = int(t.seq_len) - int(cfg.objective.max_completion_length)
        return (lambda i: i + 1), int(cfg.model.max_seq_len) - prompt_room
    if key == "objective.num_generations":
        # Whole micro-batches on every rank: G x prompts / dp a multiple of the micro-batch.
        prompts = dec.global_batch // int(cfg.objective.num_generations)
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


def _plan_with(job: JobConfig, cfg: JobConfig, key: str, value: int, settings: dict[str, Any]) -> Any:
    """The job's plan with `key` set to `value` and the savers' `settings`, or None when the config's rules
    refuse that. `job` is a copy of `cfg` that every probe sets again: each searched key to its setting or
    back to the job's own value."""
    from omegaconf import OmegaConf

    from dtlaunch.job.validate import validate
    from dtlaunch.plan.memory import plan_memory

    for k, v in {
        **{s.key: OmegaConf.select(cfg, s.key) for s in SAVERS},
        **_with(cfg, key, value),
        **_resolved(cfg, key, value, settings),
    }.items():
        OmegaConf.update(job, k, v)
    try:
        layout = validate(job).layout
    except ConfigError:
        return None
    return plan_memory(job, layout, all_stages=False)
