"""The end-of-run summary: what a finished run did, on the terminal and in RUN/summary.json.

The workers write summary.json with what only they know (final step and loss, per-rank measured peaks,
median tokens/s); the launcher completes it from files it can read without torch (metrics.jsonl,
plan.json, the checkpoint directory) and its own wall clock, so the workers' code stays short.
Existing keys are kept; the added ones are named for what they hold.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from dtlaunch.plan.lines import Line
from dtlaunch.run.run_dir import METRICS_NAME

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

SUMMARY_NAME = "summary.json"


def _last_value(rows: list[dict], key: str) -> Optional[float]:
    for row in reversed(rows):
        if isinstance(row.get(key), (int, float)):
            return float(row[key])
    return None


def complete_summary(cfg: JobConfig, layout: Any, run_dir: Path, wall_time_s: float) -> dict[str, Any]:
    """Read the workers' summary.json, add the launcher's view, write it back, return it ({} if absent)."""
    from dtlaunch.config.decisions import Decisions
    from dtlaunch.models.flops import flops_per_token, mfu
    from dtlaunch.run.checkpoints import checkpoint_root, newest_complete
    from dtlaunch.run.metrics_file import read_metrics

    path = run_dir / SUMMARY_NAME
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    rows = read_metrics(run_dir / METRICS_NAME)
    steps = int(summary.get("final_step") or 0)
    dec = Decisions.of(cfg, layout)
    tokens_per_step = dec.global_batch * int(cfg.training.seq_len) * dec.rows_per_sample
    tps = summary.get("tokens_per_s_median")
    low = str(cfg.precision.param_dtype) in ("bf16", "fp16")
    peak_tflops = float(cfg.hardware.peak_tflops_bf16 if low else cfg.hardware.peak_tflops_fp32)
    fpt = flops_per_token(cfg.model, int(cfg.training.seq_len))
    measured = summary.get("peak_mem_bytes_per_rank") or []
    planned = None
    try:
        plan = json.loads((run_dir / "plan.json").read_text())
        planned = int(plan["peak_bytes"])
        if not int(cfg.hardware.gpus_per_node):
            # A CPU run measures one memory: what offloading keeps "on the host" is in it too (plan.offload);
            # not GRPO's tool process, another process the worker's counter never sees.
            host = plan.get("host", {})
            tools = int(host.get("categories", {}).get(str(Line.TOOL_PROCESS_HOST), 0))
            planned += int(host.get("per_rank_bytes", 0)) - tools
    except (OSError, ValueError, KeyError, TypeError):
        pass
    ckpt, _ = newest_complete(checkpoint_root(cfg, run_dir)) if cfg.checkpoint.enabled else (None, [])
    final_loss = summary.get("last_loss")
    summary.update(
        {
            "steps": steps,
            "tokens": steps * tokens_per_step,
            "wall_time_s": round(wall_time_s, 2),
            "final_loss": final_loss if final_loss is not None else _last_value(rows, "loss"),
            "val_loss": summary.get("val_loss", _last_value(rows, "val_loss")),
            "tokens_per_s": tps,
            "mfu": mfu(tps, fpt, peak_tflops, int(summary.get("world") or 1)) if tps else None,
            "peak_mem_bytes_measured": max(measured) if measured else None,
            "peak_mem_bytes_planned": planned,
            "newest_checkpoint": str(ckpt.path) if ckpt is not None else None,
            "tensorboard": f"tensorboard --logdir {run_dir / 'tb'}",
        }
    )
    path.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def summary_lines(summary: dict[str, Any], run_dir: Path) -> list[str]:
    """The summary as label/value lines. Printed with soft wrapping, so a long path or command wraps at
    the terminal's edge but copies and pastes as one piece."""
    from dtlaunch.run.metrics_file import human_bytes

    rows: list[tuple[str, str]] = [
        ("steps", f"{summary.get('steps', 0):,} ({summary.get('tokens', 0):,} tokens)"),
        ("wall time", _duration(float(summary.get("wall_time_s") or 0))),
    ]
    loss = summary.get("final_loss")
    rows.append(("final loss", f"{loss:.4f}" if isinstance(loss, (int, float)) else "-"))
    if isinstance(summary.get("val_loss"), (int, float)):
        rows.append(("val loss", f"{summary['val_loss']:.4f}"))
    if isinstance(summary.get("rewards/accuracies"), (int, float)):
        rows.append(
            (
                "preference",
                f"reward accuracy {summary['rewards/accuracies']:.2f}, margin {summary['rewards/margins']:.4f} "
                f"(last step)",
            )
        )
    if isinstance(summary.get("reward"), (int, float)):  # objective=grpo: the last rollout, the time split
        rows.append(
            (
                "GRPO",
                f"reward {summary['reward']:.3f} ± {summary['reward_std']:.3f}, completions "
                f"{summary['completions/mean_length']:.1f} tokens (max {summary['completions/max_length']:.0f}, "
                f"{100 * summary['completions/clipped_ratio']:.0f}% truncated) (last rollout); "
                f"{100 * summary['generation_share']:.0f}% of step time generating at "
                f"{summary['generated_tokens_per_s']:,.0f} tokens/s",
            )
        )
    tps = summary.get("tokens_per_s")
    speed = f"{tps:,.0f} tokens/s (median)" if isinstance(tps, (int, float)) else "-"
    if isinstance(summary.get("mfu"), float):
        speed += f", MFU {100 * summary['mfu']:.1f}%"
    rows.append(("speed", speed))
    measured, planned = summary.get("peak_mem_bytes_measured"), summary.get("peak_mem_bytes_planned")
    if measured:
        mem = f"{human_bytes(measured)} measured (most loaded rank)"
        if planned:
            mem += f" vs {human_bytes(planned)} planned"
        rows.append(("peak memory", mem))
    slow = summary.get("slow_rank")
    if isinstance(slow, dict):  # dtlaunch.train.observe.stragglers: persistently slower than the others
        rows.append(
            (
                "slow rank",
                f"rank {slow['rank']}: {slow['median_ms']:.1f} ms/step (median) vs {slow['others_median_ms']:.1f} ms "
                f"on the other ranks (+{100 * slow['slower_by']:.0f}%)",
            )
        )
    rows.append(("checkpoint", summary.get("newest_checkpoint") or "none (checkpoint.enabled=false)"))
    rows.append(("tensorboard", summary.get("tensorboard", "")))
    return [f"run finished: {run_dir}"] + [f"  {label:<12} {value}" for label, value in rows]


def _duration(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else (f"{m}m {s:02d}s" if m else f"{seconds:.1f} s")
