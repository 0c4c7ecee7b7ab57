"""Worker entry point: `python -m dtlaunch.train.main` under torchrun; reads $DTLAUNCH_RUN_DIR/config.yaml.

Order: config -> process group -> mesh -> the runtime (dtlaunch.train.runtime: model on meta ->
parallelize, or pipeline split + parallelize per stage -> optimizers, schedules) -> loader -> resume ->
loop -> final save -> summary -> barrier + destroy.
"""

from __future__ import annotations

import faulthandler
import json
import math
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from dtlaunch.config.compose import load_resolved
from dtlaunch.config.layout import Layout, grad_accum_steps, pp_microbatches
from dtlaunch.errors import EXIT_BAD_INPUT, EXIT_PREEMPTED, DtlaunchError
from dtlaunch.launch.local import RUN_DIR_ENV
from dtlaunch.models.registry import model_spec
from dtlaunch.train import preempt
from dtlaunch.train.dist_init import DistEnv, init_distributed, restart_count, shutdown
from dtlaunch.train.guards import StepWatch
from dtlaunch.train.mesh import build_mesh, cp_rank_size, dp_mesh, dp_rank_size
from dtlaunch.train.parallelize import parallelize
from dtlaunch.train.peft import apply_peft
from dtlaunch.train.phases import phase
from dtlaunch.train.runtime import build_runtime
from dtlaunch.train.step_sync import StepOutcome, WindowSync


class TrainingDiverged(DtlaunchError):
    exit_code = 1


def redirect_logs(run_dir: Path, rank: int) -> None:
    """Per-rank log file logs/rank<R>.log: every rank's stderr, and stdout of ranks other than 0
    (rank 0's stdout stays on the user's terminal for the progress display)."""
    log = open(run_dir / "logs" / f"rank{rank}.log", "a", buffering=1)  # noqa: SIM115 (lives as long as the process)
    log.write(f"--- rank {rank}, attempt {restart_count()}, pid {os.getpid()}, {time.strftime('%F %T')}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log.fileno(), 2)
    if rank != 0:
        os.dup2(log.fileno(), 1)


def log(msg: str) -> None:
    """A line in this rank's log file (stderr is redirected there)."""
    print(f"[{time.strftime('%T')}] {msg}", file=sys.stderr, flush=True)


def build_parts(cfg: Any, layout: Layout, mesh: Any, env: DistEnv, accum: int, init: bool = True) -> dict:
    """The model (or this rank's pipeline stages), parallelised and initialised (allocated only with
    init=False)."""
    # RoPE tables for the positions training uses, not the model's maximum (131,072 on Llama-3.1).
    model = model_spec(cfg.model).build(cfg.model, rope_len=int(cfg.training.seq_len), device="meta")
    apply_peft(model, cfg)  # adapters + frozen base (peft.method != none), before any layout is applied
    if layout.pp == 1:
        return {"model_parts": [parallelize(model, mesh, cfg, layout, init=init)]}
    from dtlaunch.train.pipeline import build_schedule, build_stage_modules
    from dtlaunch.train.pp_step import pipeline_loss_fn
    from dtlaunch.train.tensor_parallel import cross_entropy

    pp_mesh = mesh["pp"]
    parts = build_stage_modules(model, cfg, layout, pp_mesh.get_local_rank())
    parts = [(i, parallelize(part, mesh, cfg, layout, init=init)) for i, part in parts]
    loss = pipeline_loss_fn(cross_entropy, pp_microbatches(cfg, layout), accum)
    plan = build_schedule(parts, pp_mesh, cfg, layout, loss, env.device)
    return {"model_parts": plan.model_parts, "pipeline": plan, "pipeline_loss": loss, "pp_mesh": pp_mesh}


def measure_peak_memory(tracker: Any) -> int:
    """Peak allocated bytes on this rank so far (CUDA allocator; on CPU the MemTracker-based tracker)."""
    return int(tracker.peak_bytes()) if tracker is not None else 0


@dataclass(frozen=True)
class LoopSettings:
    """The config values the loop consults every step, read once: an OmegaConf attribute read costs
    tens of microseconds, and about ten of them per step were a measurable part of a small model's step."""

    steps: int
    save_every: int  # 0: no periodic checkpoint (checkpointing off, or only at the end)
    eval_every: int
    eval_batches: int
    max_bad_steps: int
    fail_at_step: int  # fault injection (debug.*): -1 when this rank does not fail, or after a restart
    hang_at_step: int
    fail_mode: str

    @classmethod
    def of(cls, cfg: Any, rank: int) -> LoopSettings:
        t, d = cfg.training, cfg.debug
        injects = rank == int(d.fail_rank) and restart_count() == 0
        every = int(cfg.checkpoint.every_steps)
        return cls(
            steps=int(t.steps),
            save_every=every if bool(cfg.checkpoint.enabled) and every > 0 else 0,
            eval_every=int(t.eval_every),
            eval_batches=int(t.eval_batches),
            max_bad_steps=int(t.max_bad_steps),
            fail_at_step=int(d.fail_at_step) if injects else -1,
            hang_at_step=int(d.hang_at_step) if injects else -1,
            fail_mode=str(d.fail_mode),
        )

    def saves_at(self, step: int) -> bool:
        """Whether CheckpointManager.maybe_save saves at `step` (its cadence)."""
        return self.save_every > 0 and step % self.save_every == 0

    def evaluates_at(self, step: int) -> bool:
        """Evaluate after this optimizer step: every training.eval_every steps and at the last one."""
        return self.eval_every > 0 and (step % self.eval_every == 0 or step == self.steps)


def maybe_fail(loop: LoopSettings, step: int) -> None:
    """Fault injection for tests: fail `debug.fail_rank` at `debug.fail_at_step`, first attempt only."""
    if step == loop.fail_at_step:
        if loop.fail_mode == "sigkill":  # a real crash: no Python error, no error file, exit -9
            os.kill(os.getpid(), signal.SIGKILL)
        if loop.fail_mode == "input":  # bad input only a worker can see (e.g. a corrupt data window)
            from dtlaunch.errors import InputError

            raise InputError(f"injected input error at step {step} (debug.fail_at_step)")
        raise RuntimeError(f"injected failure at step {step} (debug.fail_at_step)")
    if step == loop.hang_at_step:
        # A stuck rank: its peers' next collective must time out (launch.timeout_s) and name it. It ends
        # when the launcher stops it, like a process with the default SIGTERM action.
        log(f"hanging at step {step} (debug.hang_at_step)")
        while not preempt.requested():
            time.sleep(0.05)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


@record
def main() -> None:
    preempt.install()  # first, so that an early SIGTERM/SIGUSR1 is not fatal
    run_dir = Path(os.environ[RUN_DIR_ENV])
    redirect_logs(run_dir, int(os.environ.get("RANK", "0")))
    # A crash inside torch's C++ (a segfault in a collective) kills the rank with no Python trace and
    # torchrun reports only the signal: dump every thread's stack into the rank's log first.
    faulthandler.enable(all_threads=True)
    cfg = load_resolved(run_dir / "config.yaml")
    env = init_distributed(cfg)
    try:
        train(cfg, run_dir, env)
    except preempt.PreemptionStop as stop:  # checkpoint saved; a new start resumes
        if env.rank == 0 and cfg.checkpoint.enabled:
            preempt.write_marker(run_dir, stop.step, stop.signum)
        log(f"{stop}: checkpoint saved, exiting {EXIT_PREEMPTED}")
        shutdown(EXIT_PREEMPTED)
    except DtlaunchError as exc:
        if exc.exit_code != EXIT_BAD_INPUT:
            raise
        # The user's input, found wrong only here: the launcher reports it as such (exit 2).
        from dtlaunch.launch.worker_errors import exit_with_input_error

        exit_with_input_error(run_dir, env.rank, str(exc))
    # Only after success: on an error, peers may sit in a collective, and a barrier would hang this rank
    # instead of letting it exit so that torchrun stops the others.
    shutdown()


def train(cfg: Any, run_dir: Path, env: DistEnv) -> None:
    from dtlaunch.train.checkpoint import CheckpointManager
    from dtlaunch.train.data import build_loaders
    from dtlaunch.train.evaluate import evaluate
    from dtlaunch.train.memtrack import PeakTracker
    from dtlaunch.train.metrics import MetricsLogger

    torch.manual_seed(int(cfg.training.seed))
    layout = Layout.resolve(cfg.strategy, env.world)
    mesh = build_mesh(layout, env.device.type)
    accum = grad_accum_steps(cfg, layout)
    log(f"rank {env.rank}/{env.world} {env.backend} on {env.device}; mesh {mesh}; accumulation {accum}")
    phase(f"building the model ({cfg.model.name}) on {env.world} worker(s)")
    rt = build_runtime(cfg, env, layout, mesh)
    parts, optimizers, schedulers = rt.model_parts, rt.optimizers, rt.schedulers
    log(
        f"parallelised: {sum(_local_numel(p) for m in parts for p in m.parameters()):,} parameter elements "
        f"on this rank in {len(parts)} part(s)"
    )
    dp_rank, dp_size = dp_rank_size(mesh)
    loader, val_loader = build_loaders(cfg, run_dir, dp_rank, dp_size, *cp_rank_size(mesh))
    ctx = rt.step_context(loader, moe=_router_tracker(cfg, parts, mesh, layout, accum))
    ckpt = CheckpointManager(cfg, run_dir, parts, optimizers, schedulers, loader, env.rank)
    start = ckpt.resume()
    log(f"training steps {start + 1}..{cfg.training.steps}")
    metrics = MetricsLogger(run_dir, cfg, enabled=env.rank == 0)
    tracker = PeakTracker(parts, optimizers, enabled=True, device=env.device)
    tokens_per_step = accum * int(cfg.training.micro_batch) * dp_size * int(cfg.training.seq_len)
    rates: list[float] = []
    state = _LoopState()
    last_eval: dict[str, float] = {}
    watch = StepWatch(env.rank, env.world, float(cfg.launch.timeout_s))  # names a late rank
    loop = LoopSettings.of(cfg, env.rank)
    sync = WindowSync(env.device, int(cfg.training.log_every), loop.steps, float(cfg.training.sync_interval_s))
    for step in range(start + 1, loop.steps + 1):
        maybe_fail(loop, step)
        lr = schedulers[0].get_last_lr()[0]
        began = time.perf_counter()
        with watch.step(step), tracker.step(step):
            result = rt.step(ctx, step)
            rates.append(tokens_per_step / (time.perf_counter() - began))
            done = sync.push(
                step,
                result.local_loss,
                result.grad_norm,
                result.applied,
                preempt.requested(),
                stats=result.router_stats,
                lr=lr,
                rate=rates[-1],
            )
        # Outside the step's timing; its own loader and no RNG, so training and resume are unaffected.
        evaluated = evaluate(ctx, val_loader, loop.eval_batches) if val_loader and loop.evaluates_at(step) else {}
        if evaluated:
            last_eval = state.evals[step] = evaluated
        _account(done, loop, metrics, tracker, state, ctx.moe)
        if loop.saves_at(step):
            # A checkpointed step's metrics line must exist before a restart can resume after it.
            with watch.step(step):
                _account(sync.drain(), loop, metrics, tracker, state, ctx.moe)
            metrics.flush()
        ckpt.maybe_save(step)
        # Preemption: every rank read the same window, so all stop after this step and save it.
        if sync.signum:
            with watch.step(step):
                _account(sync.drain(), loop, metrics, tracker, state, ctx.moe)
            preempt.stopping(sync.signum)
            if step < loop.steps:
                ckpt.save(step, final=True)
                ckpt.close()
                metrics.close()
                metrics.finish_trackers(None)
                raise preempt.PreemptionStop(step, sync.signum)
        state.ended[step] = time.perf_counter()
    with watch.step(loop.steps):
        _account(sync.drain(), loop, metrics, tracker, state, ctx.moe)
    skipped_total, last_loss = state.skipped_total, state.last_loss
    final_step = max(start, loop.steps)
    ckpt.save(final_step, final=True)
    ckpt.close()
    metrics.close()
    summary = write_summary(
        run_dir, env, final_step, last_loss, rates, skipped_total, measure_peak_memory(tracker), last_eval
    )
    metrics.finish_trackers(summary)
    log(f"done at step {final_step}; {skipped_total} skipped step(s)")


class _LoopState:
    """Counters the loop keeps across windows of step outcomes."""

    def __init__(self) -> None:
        self.bad = 0
        self.skipped_total = 0
        self.last_loss: float | None = None
        self.ended: dict[int, float] = {}  # step -> perf_counter at the end of its loop iteration
        self.evals: dict[int, dict[str, float]] = {}  # step -> validation metrics computed after it


def _router_tracker(cfg: Any, parts: list, mesh: Any, layout: Layout, accum: int) -> Any:
    """Balancing and router statistics of an MoE model (None for dense ones). The aux loss's gradient
    is scaled like the loss: by 1 / the micro-batches (pipeline ones included) summed into a step."""
    from dtlaunch.train.moe_stats import RouterTracker

    # The data-parallel group only for the bias update (the statistics ride on the loop's window sync).
    dp = dp_mesh(mesh, flatten=True) if float(getattr(cfg.model.moe, "bias_update_rate", 0) or 0) > 0 else None
    n_mb = pp_microbatches(cfg, layout) if layout.pp > 1 else 1
    group = dp.get_group() if dp is not None else None
    return RouterTracker.maybe(cfg, parts, group, layout.tp, 1.0 / (accum * n_mb), pipeline=layout.pp > 1)


def _account(
    done: list[StepOutcome], loop: LoopSettings, metrics: Any, tracker: Any, state: _LoopState, moe: Any = None
) -> None:
    """Metrics lines and the bad-step check for the steps whose window was just read."""
    peak = measure_peak_memory(tracker) if done else 0  # once per window, not per step
    for out in done:
        skipped = not out.applied or not math.isfinite(out.loss)
        state.last_loss = out.loss
        state.bad = state.bad + 1 if skipped else 0
        state.skipped_total += int(skipped)
        values = {
            "loss": out.loss,
            "lr": out.host["lr"],
            "grad_norm": out.grad_norm,
            "tokens_per_s": out.host["rate"],
            "peak_mem_bytes": peak,
            "skipped": int(skipped),
            **state.evals.pop(out.step, {}),
            **(moe.summarize(out.stats) if moe is not None and out.stats else {}),
        }
        if out.step in state.ended:  # the step's own end, not when its window was read
            values["ended_at"] = state.ended.pop(out.step)
        metrics.log(out.step, values)
        if skipped and state.bad >= loop.max_bad_steps:
            raise TrainingDiverged(
                f"{state.bad} steps in a row with a non-finite loss or gradient norm (last at step "
                f"{out.step}): lower optim.lr, or raise training.max_bad_steps"
            )


def _local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()


def write_summary(
    run_dir: Path,
    env: DistEnv,
    step: int,
    last_loss: float | None,
    rates: list[float],
    skipped: int,
    peak: int,
    last_eval: dict[str, float] | None = None,
) -> dict[str, Any] | None:
    peaks = [0] * env.world
    dist.all_gather_object(peaks, peak)
    if env.rank != 0:
        return None
    summary = {
        "final_step": step,
        "last_loss": last_loss,
        "tokens_per_s_median": statistics.median(rates) if rates else None,
        "skipped_steps": skipped,
        "peak_mem_bytes_per_rank": peaks,
        "world": env.world,
        **(last_eval or {}),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
