"""The training loop, read top to bottom: `Trainer(cfg, run_dir, env).fit()`.

Built once: the runtime (dtlaunch.train.runtime: model parts, optimizers, schedules), the data loaders,
the checkpoint manager (which resumes), metrics and the peak-memory tracker. Each step: the optimizer step
(dtlaunch.train.step, its loss dtlaunch.train.loss), the step's outcome into the window the ranks agree on
(dtlaunch.train.step_sync), evaluation, metrics lines, the checkpoint cadence, and a preemption stop.
Every way out (finished, preempted, failed) goes through `close`. Fault injection for tests (debug.*)
wraps the step numbers, the step function and the final save at setup (dtlaunch.train.features.fault_injection),
never a call in the loop.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from dtlaunch.errors import DtlaunchError
from dtlaunch.run import preemption
from dtlaunch.run.phases import phase, rank_log, startup_stamp
from dtlaunch.train.checkpoint.manager import CheckpointManager
from dtlaunch.train.features.evaluate import evaluate
from dtlaunch.train.features.fault_injection import Faults
from dtlaunch.train.observe.guards import StepWatch
from dtlaunch.train.observe.memtrack import PeakTracker
from dtlaunch.train.observe.metrics import MetricsLogger
from dtlaunch.train.observe.profiling import profiled
from dtlaunch.train.observe.stragglers import RankPace, StragglerWatch, rank_times
from dtlaunch.train.parallel.mesh import dp_rank_size
from dtlaunch.train.parallel.process_group import DistEnv
from dtlaunch.train.runtime import build_runtime
from dtlaunch.train.step import train_step
from dtlaunch.train.step_sync import StepOutcome, WindowSync

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


class TrainingDiverged(DtlaunchError):
    exit_code = 1


class Outcome(str, Enum):
    FINISHED = "finished"
    PREEMPTED = "preempted"
    FAILED = "failed"


@dataclass(frozen=True)
class LoopSettings:
    """The config values the loop consults every step, read once: an OmegaConf attribute read costs
    tens of microseconds, and about ten of them per step were a measurable part of a small model's step."""

    steps: int
    save_every: int  # 0: no periodic checkpoint (checkpointing off, or only at the end)
    eval_every: int
    eval_batches: int
    max_bad_steps: int

    @classmethod
    def of(cls, cfg: JobConfig) -> LoopSettings:
        t = cfg.training
        every = int(cfg.checkpoint.every_steps)
        return cls(
            steps=int(t.steps),
            save_every=every if bool(cfg.checkpoint.enabled) and every > 0 else 0,
            eval_every=int(t.eval_every),
            eval_batches=int(t.eval_batches),
            max_bad_steps=int(t.max_bad_steps),
        )

    def saves_at(self, step: int) -> bool:
        """Whether CheckpointManager.maybe_save saves at `step` (its cadence)."""
        return self.save_every > 0 and step % self.save_every == 0

    def evaluates_at(self, step: int) -> bool:
        """Evaluate after this optimizer step: every training.eval_every steps and at the last one."""
        return self.eval_every > 0 and (step % self.eval_every == 0 or step == self.steps)


class _Totals:
    """What the loop keeps across windows of step outcomes."""

    def __init__(self) -> None:
        self.bad = 0
        self.skipped = 0
        self.last_loss: Optional[float] = None
        self.rates: list[float] = []  # tokens/s of every step this attempt ran
        self.ended: dict[int, float] = {}  # step -> perf_counter at the end of its loop iteration
        self.evals: dict[int, dict[str, float]] = {}  # step -> validation metrics computed after it
        self.last_eval: dict[str, float] = {}
        self.last_pairs: dict[str, float] = {}  # preference objectives: the last step's reward metrics
        self.rollouts: dict[int, dict[str, float]] = {}  # objective=grpo: step -> its rollout's metrics
        self.last_rollout: dict[str, float] = {}
        self.generation_s = 0.0  # objective=grpo: this attempt's seconds generating, and in the rest of the steps
        self.training_s = 0.0
        self.generated_tokens = 0.0
        self.stragglers: Optional[StragglerWatch] = None  # global rank 0: the per-rank times, the slow rank

    def add_rollout(self, step: int, metrics: dict[str, float], step_s: float) -> None:
        """A GRPO step's rollout metrics (none on a rollout's later iterations) and its time split: generation,
        and training (the step less its rollout: rewards, old-policy / reference passes, forward, backward)."""
        generation = metrics.get("time/generation_s", 0.0)
        training = step_s - metrics.get("time/rollout_s", 0.0)
        self.rollouts[step] = {**metrics, "time/training_s": training}
        self.generation_s += generation
        self.training_s += step_s - generation
        self.generated_tokens += metrics.get("generated_tokens_per_s", 0.0) * generation


class Trainer:
    def __init__(self, cfg: JobConfig, run_dir: Path, env: DistEnv) -> None:
        torch.manual_seed(int(cfg.training.seed))
        self.cfg, self.run_dir, self.env = cfg, run_dir, env
        phase(f"building the model ({cfg.model.name}) on {env.world} worker(s)")
        self.rt = rt = build_runtime(cfg, env)
        startup_stamp("mesh and model built")
        rank_log(
            f"rank {env.rank}/{env.world} {env.backend} on {env.device}; mesh {rt.mesh}; accumulation {rt.accum}; "
            f"{sum(_local_numel(p) for m in rt.model_parts for p in m.parameters()):,} parameter elements on "
            f"this rank in {len(rt.model_parts)} part(s)"
        )
        dp_rank, dp_size = dp_rank_size(rt.mesh)
        # The objective's data: its loaders and, for objective=grpo, the rollout that turns prompts into the
        # rows each step trains on (dtlaunch.train.objectives.step_data).
        data = rt.objective.step_data(cfg, run_dir, rt, dp_rank, dp_size)
        self.loader, self.val_loader, self.rollout = data.loader, data.val_loader, data.rollout
        self.ckpt = CheckpointManager(cfg, run_dir, rt.model_parts, rt.optimizers, rt.schedulers, self.loader, env.rank)
        self.start = self.ckpt.resume()
        self.metrics = MetricsLogger(run_dir, cfg, enabled=env.rank == 0)
        # DPO's frozen reference copy is counted too (it is no model part: nothing trains it).
        held = [*rt.model_parts, *(rt.reference.modules if rt.reference is not None else [])]
        self.tracker = PeakTracker(held, rt.optimizers, enabled=True, device=env.device)
        self.watch = StepWatch(env.rank, env.world, float(cfg.launch.timeout_s))  # names a late rank
        self.loop = LoopSettings.of(cfg)
        t = cfg.training
        self.totals = _Totals()
        # Each rank's time per step rides on the window collective; rank 0 names a slow rank.
        self.pace = RankPace(env.rank, env.world) if float(t.straggler_threshold) > 0 and env.world > 1 else None
        if self.pace is not None and env.rank == 0:
            self.totals.stragglers = StragglerWatch(env.world, float(t.straggler_threshold))
        self.sync = WindowSync(env.device, int(t.log_every), self.loop.steps, float(t.sync_interval_s), pace=self.pace)
        self.tokens_per_step = rt.decisions.rows_per_sample * rt.accum * int(t.micro_batch) * dp_size * int(t.seq_len)
        # train_step and the loader themselves unless profiling.enabled (then the profiled steps are traced)
        self.step_fn, self.step_loader = profiled(train_step, self.loader, cfg, run_dir, env.rank, env.device)
        # Tests only (debug.*); each wrapper is what it wraps in a real run.
        faults = Faults.of(cfg, env.rank)
        self.rollout = faults.wrap_rollout(self.rollout)
        self.step_fn = faults.wrap_step(self.step_fn)
        self.steps = faults.wrap_steps(range(self.start + 1, self.loop.steps + 1))
        self.save_final = faults.wrap_final_save(functools.partial(self.ckpt.save, final=True), self.loop.steps)

    def fit(self) -> None:
        """Steps start+1 .. training.steps, then the final checkpoint and the summary. A preemption stop
        saves the step it stopped after and raises PreemptionStop (the worker exits 75)."""
        loop, rt, sync, step_fn, batches = self.loop, self.rt, self.sync, self.step_fn, self.step_loader
        rank_log(f"training steps {self.start + 1}..{loop.steps}")
        startup_stamp("loop started")
        try:
            for step in self.steps:
                lr = rt.schedulers[0].get_last_lr()[0]
                began = time.perf_counter()
                with self.watch.step(step), self.tracker.step(step):
                    if self.pace is not None:
                        self.pace.started()
                    if self.rollout is not None:  # generation and rewards: this step's rows
                        batches = self.rollout.batches(step)
                    result = step_fn(rt, batches, step)
                    if self.rollout is not None:
                        self.totals.add_rollout(step, batches.metrics, time.perf_counter() - began)
                    if self.pace is not None:
                        self.pace.ended()
                    rate = self.tokens_per_step / (time.perf_counter() - began)
                    self.totals.rates.append(rate)
                    done = sync.push(
                        step,
                        result.local_loss,
                        result.grad_norm,
                        result.applied,
                        preemption.requested(),
                        stats=_step_stats(result),
                        lr=lr,
                        rate=rate,
                    )
                self._evaluate(step)
                self._record(done)
                if loop.saves_at(step):
                    # A checkpointed step's metrics line must exist before a restart can resume after it.
                    self._drain(step)
                    self.metrics.flush()
                self.ckpt.maybe_save(step)
                # Preemption: every rank read the same window, so all stop after this step and save it; a
                # GRPO generation batch is finished first (a resume regenerates at a batch's first step).
                if sync.signum and (self.rollout is None or self.rollout.last_step_of_batch(step)):
                    self._drain(step)
                    preemption.stopping(sync.signum)
                    if step < loop.steps:
                        self.ckpt.save(step, final=True)
                        self.close(Outcome.PREEMPTED)
                        raise preemption.PreemptionStop(step, sync.signum)
                self.totals.ended[step] = time.perf_counter()
            self._drain(loop.steps)
            final_step = max(self.start, loop.steps)
            self.save_final(final_step)
        except (preemption.PreemptionStop, KeyboardInterrupt):
            raise
        except BaseException:
            try:
                self.close(Outcome.FAILED)
            except Exception as exc:  # never hide the error that stopped the run
                rank_log(f"closing after the failure also failed: {exc!r}")
            raise
        self.close(Outcome.FINISHED, final_step)

    def close(self, outcome: Outcome, final_step: int = 0) -> None:
        """The one way out. Finished and preempted runs wait for a checkpoint in flight (a collective: every
        rank is here); a failed one only closes this rank's files, since its peers may be stuck."""
        if self.rollout is not None:
            self.rollout.close()
        if outcome is not Outcome.FAILED:
            self.ckpt.close()
        self.metrics.close()
        summary = None
        if outcome is Outcome.FINISHED:
            summary = self._write_summary(final_step)
            rank_log(f"done at step {final_step}; {self.totals.skipped} skipped step(s)")
        self.metrics.finish_trackers(summary)

    def _evaluate(self, step: int) -> None:
        """Outside the step's timing; its own loader and no RNG, so training and resume are unaffected."""
        if self.val_loader is not None and self.loop.evaluates_at(step):
            evaluated = evaluate(self.rt, self.val_loader, self.loop.eval_batches)
            if evaluated:
                self.totals.last_eval = self.totals.evals[step] = evaluated

    def _drain(self, step: int) -> None:
        """Read every window still in flight (a collective, watched like a step)."""
        with self.watch.step(step):
            self._record(self.sync.drain())

    def _record(self, done: list[StepOutcome]) -> None:
        """Metrics lines and the bad-step check for the steps whose window was just read."""
        totals = self.totals
        peak = self._peak() if done else 0  # once per window, not per step
        for out in done:
            skipped = not out.applied or not math.isfinite(out.loss)
            totals.last_loss = out.loss
            totals.bad = totals.bad + 1 if skipped else 0
            totals.skipped += int(skipped)
            values = {
                "loss": out.loss,
                "lr": out.host["lr"],
                "grad_norm": out.grad_norm,
                "tokens_per_s": out.host["rate"],
                "peak_mem_bytes": peak,
                "skipped": int(skipped),
                **totals.evals.pop(out.step, {}),
                **self._rollout_values(out.step),
                **self._stats_values(out.stats),
            }
            if out.step in totals.ended:  # the step's own end, not when its window was read
                values["ended_at"] = totals.ended.pop(out.step)
            if out.ranks is not None and totals.stragglers is not None:
                values.update(rank_times(out.ranks, totals.stragglers))
            self.metrics.log(out.step, values)
            if skipped and totals.bad >= self.loop.max_bad_steps:
                raise TrainingDiverged(
                    f"{totals.bad} steps in a row with a non-finite loss or gradient norm (last at step "
                    f"{out.step}): lower optim.lr, or raise training.max_bad_steps"
                )

    def _rollout_values(self, step: int) -> dict[str, float]:
        """objective=grpo: the metrics of the rollout this step generated (none on its later iterations)."""
        values = self.totals.rollouts.pop(step, {})
        if "reward" in values:
            self.totals.last_rollout = values
        return values

    def _stats_values(self, stats: Optional[list[float]]) -> dict[str, float]:
        """A step's extra vector: the router statistics (MoE), then the objective's (preference, GRPO)."""
        if not stats:
            return {}
        objective = self.rt.objective
        pairs = objective.stats_len
        router, pair = stats[: len(stats) - pairs], stats[len(stats) - pairs :]
        values = self.rt.moe.summarize(router) if self.rt.moe is not None and router else {}
        if pair:
            self.totals.last_pairs = objective.summarize(pair)
        return {**values, **self.totals.last_pairs} if pair else values

    def _peak(self) -> int:
        """Peak allocated bytes on this rank so far (CUDA allocator; on CPU the storage counter)."""
        return int(self.tracker.peak_bytes())

    def _reserved(self) -> int:
        """Peak bytes the CUDA caching allocator reserved on this rank so far; 0 off CUDA."""
        device = torch.device(self.env.device)
        return int(torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else 0

    def _write_summary(self, step: int) -> Optional[dict[str, Any]]:
        """summary.json (rank 0): what only the workers know, for the launcher's end-of-run summary."""
        pairs: list[Any] = [None] * self.env.world
        dist.all_gather_object(pairs, (self._peak(), self._reserved()))
        if self.env.rank != 0:
            return None
        peaks, reserved = [int(p[0]) for p in pairs], [int(p[1]) for p in pairs]
        t = self.totals
        summary = {
            "final_step": step,
            "last_loss": t.last_loss,
            "tokens_per_s_median": statistics.median(t.rates) if t.rates else None,
            "skipped_steps": t.skipped,
            "peak_mem_bytes_per_rank": peaks,
            # torch.cuda.max_memory_reserved: the caching allocator's segments (0 on CPU, where it has none).
            "peak_reserved_bytes_per_rank": reserved,
            "world": self.env.world,
            **t.last_eval,
            **t.last_pairs,
            **{k: v for k, v in t.last_rollout.items() if not k.startswith("time/")},
            **(_time_split(t) if t.last_rollout else {}),
            **(t.stragglers.summary() if t.stragglers is not None else {}),
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary


def _time_split(t: _Totals) -> dict[str, float]:
    """objective=grpo over the whole attempt: the share of step time spent generating, and the rate."""
    total = t.generation_s + t.training_s
    return {
        "generation_share": t.generation_s / total if total else 0.0,
        "generated_tokens_per_s": t.generated_tokens / t.generation_s if t.generation_s else 0.0,
    }


def _step_stats(result: Any) -> Optional[torch.Tensor]:
    parts = [t for t in (result.router_stats, result.pair_stats) if t is not None]
    return torch.cat([t.float().reshape(-1) for t in parts]) if parts else None


def _local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()
