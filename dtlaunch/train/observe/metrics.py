"""What the user sees of a run (global rank 0 only): metrics.jsonl, TensorBoard, a progress display
and loss.png.

No device sync per step: `log()` accepts values that are still tensors on the GPU and only keeps
references; every `training.log_every` steps (and at `close()`) the buffered window is turned into
numbers at once (the first `.item()` waits for the GPU, the rest are free), one JSON line is written
per step, and tokens/s is the window's tokens over its wall time. The trade-off: metrics.jsonl and
the display lag by up to log_every steps, and a crash loses at most that many lines; log_every=1
gives per-step lines at the cost of one sync per step (harmless on CPU).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from dtlaunch.models.flops import flops_per_token, mfu
from dtlaunch.run.metrics_file import human_bytes, write_loss_plot
from dtlaunch.run.run_dir import METRICS_NAME

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

TB_BATCH_S = 5.0  # seconds between hand-overs of buffered scalars to TensorBoard

# Keys shown on the progress line, with their format.
_SHOWN = (
    ("loss", "loss {:.4f}"),
    ("lr", "lr {:.2e}"),
    ("grad_norm", "gnorm {:.3f}"),
    ("tokens_per_s", "{:,.0f} tok/s"),
    ("val_loss", "val_loss {:.4f}"),
    # Preference objectives (dtlaunch.train.objectives): chosen rewarded above rejected, and by how much.
    ("rewards/accuracies", "acc {:.2f}"),
    ("rewards/margins", "margin {:.3f}"),
    # objective=grpo (dtlaunch.train.objectives.rollout): the rollout's mean reward, lengths and speed.
    ("reward", "reward {:.3f}"),
    ("completions/mean_length", "len {:.1f}"),
    ("generated_tokens_per_s", "gen {:,.0f} tok/s"),
)


def _number(v: Any) -> Any:
    """A tensor (possibly on the GPU) or a number -> a plain Python value (this is where we sync)."""
    if hasattr(v, "item") and callable(v.item):
        v = v.detach().float().item() if hasattr(v, "detach") else v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else v  # JSON has no NaN; keep the line valid
    return v


def _peak_mem_bytes() -> int:
    """Accelerator peak allocation, else this process's peak resident set (CPU runs)."""
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.max_memory_allocated())
    except ImportError:
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


class MetricsLogger:
    """`log(step, values)` every step; `close()` at the end. A no-op unless `enabled` (rank 0)."""

    def __init__(self, run_dir: Path, cfg: JobConfig, enabled: bool) -> None:
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.cfg = cfg
        self.log_every = max(1, int(cfg.training.log_every))
        self.total_steps = int(cfg.training.steps)
        self._pending: list[tuple[int, dict[str, Any]]] = []
        self._closed = False
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = (self.run_dir / METRICS_NAME).open("a", buffering=1)
        self._tb: Any = None
        self._tb_rows: list[tuple[int, float, list[tuple[str, float]]]] = []  # (step, wall time, scalars)
        self._tb_sent = 0.0  # the first step's scalars go at once (creates the event file early)
        self._t0 = self._t_window = time.perf_counter()
        self._world, self._tokens_per_step = _world_and_tokens(cfg)
        self._fpt = flops_per_token(cfg.model, int(cfg.training.seq_len))
        low = str(cfg.precision.param_dtype) in ("bf16", "fp16")
        self._peak_tflops = float(cfg.hardware.peak_tflops_bf16 if low else cfg.hardware.peak_tflops_fp32)
        self._display = _Display(self.total_steps)
        self._use_tb = "tensorboard" in [str(t) for t in cfg.logging.trackers]
        from dtlaunch.train.observe.trackers import Trackers

        self._trackers = Trackers(self.run_dir, cfg)
        self._t0 = self._t_window = time.perf_counter()  # a tracker's start-up is no training time

    def log(self, step: int, values: dict[str, Any]) -> None:
        """Record one step. Tensor values are kept as they are until the window is flushed."""
        if not self.enabled:
            return
        self._pending.append((int(step), dict(values)))
        if step % self.log_every == 0 or step >= self.total_steps:
            self.flush()

    def flush(self) -> None:
        if not self.enabled or not self._pending:
            return
        rows = [(s, {k: _number(v) for k, v in vals.items()}) for s, vals in self._pending]
        now = time.perf_counter()
        tokens = sum(v.get("tokens", self._tokens_per_step) or 0 for _, v in rows)
        window_tps = tokens / max(now - self._t_window, 1e-9)
        self._t_window = now
        # Only measured here when the loop did not pass it (it costs a syscall or a device query).
        peak = _peak_mem_bytes() if any("peak_mem_bytes" not in v for _, v in rows) else 0
        for step, vals in rows:
            rec: dict[str, Any] = {"step": step}
            rec.update(vals)
            rec.setdefault("tokens_per_s", window_tps)
            u = mfu(rec["tokens_per_s"] or 0.0, self._fpt, self._peak_tflops, self._world)
            if u is not None:
                rec.setdefault("mfu", u)
            rec.setdefault("peak_mem_bytes", peak)
            # When the step itself ended (the loop passes it: lines are written a window after their step).
            rec["elapsed_s"] = round(rec.pop("ended_at", now) - self._t0, 4)
            rec["time"] = round(time.time(), 3)  # wall clock, for launch-overhead measurements
            self._jsonl.write(json.dumps(rec) + "\n")
            self._write_tb(step, rec)
            self._trackers.log(step, rec)
        self._display.update(rows[-1][0], rec)
        self._pending.clear()

    def _write_tb(self, step: int, rec: dict[str, Any]) -> None:
        """A step's scalars become one TensorBoard event, handed over in batches every TB_BATCH_S seconds
        (and at close). One event per scalar (SummaryWriter.add_scalar) cost 210 us of CPU per step for
        eight scalars, most of it tensorboard's pure-Python record checksums, one per event; one event
        holding all of them costs 87 us. TensorBoard writes its file only every flush_secs (120 s)
        anyway, so nothing shows up later than before."""
        if not self._use_tb:
            return
        values = [
            (k.replace("val_", "val/", 1) if k.startswith("val_") else f"train/{k}", float(v))
            for k, v in rec.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
        ]
        self._tb_rows.append((step, float(rec.get("time") or time.time()), values))
        if time.perf_counter() - self._tb_sent >= TB_BATCH_S:
            self._flush_tb()

    def _flush_tb(self) -> None:
        self._tb_sent = time.perf_counter()
        if not self._tb_rows:
            return
        # Lazy: pulls in tensorboard. FileWriter is SummaryWriter's own event writer; a Summary with
        # several `simple_value`s is what add_scalar writes, one value at a time.
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard.writer import FileWriter

        if self._tb is None:
            self._tb = FileWriter(str(self.run_dir / "tb"))
        for step, wall, values in self._tb_rows:
            summary = Summary(value=[Summary.Value(tag=tag, simple_value=v) for tag, v in values])
            self._tb.add_summary(summary, step, wall)
        self._tb_rows.clear()

    def finish_trackers(self, summary: Optional[dict[str, Any]]) -> None:
        """Hand the end-of-run summary (None: the run stopped early) to W&B / MLflow and close them."""
        if self.enabled:
            self._trackers.finish(summary)

    def close(self) -> None:
        """Flush the last window, close the files and write loss.png (training.loss_plot). Safe to call twice."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        self.flush()
        self._display.stop()
        self._jsonl.close()
        self._flush_tb()
        if self._tb is not None:
            self._tb.close()
        if self.cfg.training.loss_plot:
            write_loss_plot(
                self.run_dir / METRICS_NAME,
                self.run_dir / "loss.png",
                title=f"{self.cfg.recipe or 'run'}: {self.cfg.model.name}",
            )


def _world_and_tokens(cfg: JobConfig) -> tuple[int, Optional[int]]:
    """(devices in the job, tokens per optimizer step) for tokens/s and MFU when the loop does not say."""
    from dtlaunch.config.decisions import Decisions
    from dtlaunch.config.layout import Layout, world_size

    world = int(os.environ.get("WORLD_SIZE", "0")) or world_size(cfg)
    try:
        layout = Layout.resolve(cfg.strategy, world)
    except Exception:  # a layout the validator would refuse never reaches a worker; be lenient here
        return world, None
    return world, Decisions.of(cfg, layout).global_batch * int(cfg.training.seq_len)


class _Display:
    """A rich progress bar on a terminal; plain lines (one per flush) in logs and CI."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.live = sys.stdout.isatty() and os.environ.get("DTLAUNCH_PROGRESS", "") != "plain"
        self._progress: Any = None
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            # What must stay visible at 80 columns comes first (step/total, loss, tokens/s, ETA); the bar
            # takes what is left, and the other values are in metrics.jsonl and TensorBoard.
            self._progress = Progress(
                TextColumn("[bold]train"),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeRemainingColumn(),
                BarColumn(bar_width=None),
            )
            self._task = self._progress.add_task("train", total=total, stats="")
            self._progress.start()

    @staticmethod
    def describe(rec: dict[str, Any]) -> str:
        parts = [fmt.format(rec[k]) for k, fmt in _SHOWN if isinstance(rec.get(k), (int, float))]
        if isinstance(rec.get("mfu"), float):
            parts.append(f"mfu {100 * rec['mfu']:.1f}%")
        if isinstance(rec.get("peak_mem_bytes"), int):
            parts.append(f"mem {human_bytes(rec['peak_mem_bytes'])}")
        if isinstance(rec.get("slow_rank"), int):  # dtlaunch.train.observe.stragglers
            parts.append(f"slow rank {rec['slow_rank']}: {rec['slow_rank_ms']:.1f} vs {rec['others_ms']:.1f} ms/step")
        return " | ".join(parts)

    def update(self, step: int, rec: dict[str, Any]) -> None:
        stats = self.describe(rec)
        if self._progress is not None:
            short = " | ".join(
                p for p in stats.split(" | ") if p.startswith(("loss", "val_loss", "slow rank")) or p.endswith("tok/s")
            )
            self._progress.update(self._task, completed=step, stats=short)
        else:
            print(f"step {step}/{self.total} | {stats}", flush=True)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
