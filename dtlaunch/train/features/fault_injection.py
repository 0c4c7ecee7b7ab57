"""Fault injection for tests (the debug.* section), kept out of the training loop: a rank that fails, hangs,
holds or runs slow at a chosen step, steps whose loss is NaN, and GRPO rollouts that take recorded
completions instead of sampling (`wrap_rollout`).

The Trainer applies the wrappers once, at setup: `wrap_steps` around the step numbers the loop runs over
(a fault at step N strikes before that step starts, before the rank records that it reached it, as a rank
that never got there), `wrap_step` around the step function (NaN outputs), `wrap_final_save` around the
run's last checkpoint (a fault "after the last step", at training.steps + 1), and the checkpoint manager
applies `wrap_writer` to its storage writer (a slow save). A real run has none of them
(every field at its default), and then each wrapper returns what it was given: its loop holds no fault
call.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch

from dtlaunch.errors import InputError
from dtlaunch.run import preemption
from dtlaunch.run.phases import rank_log
from dtlaunch.train.parallel.process_group import restart_count

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


@dataclass(frozen=True)
class Faults:
    """The debug.* values for this rank, read once (the loop consults them every step)."""

    fail_at_step: int  # -1 when this rank does not fail, or after a restart
    hang_at_step: int
    fail_mode: str
    hold_at_step: int
    slow_step_s: float  # this rank sleeps this long in every step (0: not this rank)
    nan_at_steps: frozenset[int]  # every rank's loss is NaN at these steps
    slow_save_s: float = 0.0  # rank 1's checkpoint writes start this late (kill-during-save tests)
    replay_completions: str = ""  # objective=grpo: a JSONL of completions the rollouts take instead of sampling

    @classmethod
    def of(cls, cfg: JobConfig, rank: int) -> Faults:
        d = cfg.debug
        injects = rank == int(d.fail_rank) and restart_count() == 0
        return cls(
            fail_at_step=int(d.fail_at_step) if injects else -1,
            hang_at_step=int(d.hang_at_step) if injects else -1,
            fail_mode=str(d.fail_mode),
            hold_at_step=int(d.hold_at_step) if injects else -1,
            slow_step_s=float(d.slow_step_s) if rank == int(d.fail_rank) else 0.0,
            nan_at_steps=frozenset(int(s) for s in d.nan_at_steps),
            slow_save_s=float(d.slow_save_s) if rank == 1 else 0.0,
            replay_completions=str(d.replay_completions),
        )

    def wrap_steps(self, steps: Iterable[int]) -> Iterable[int]:
        """The loop's step numbers, each preceded by this rank's fault at that step (fail, hang or hold) and
        its sleep (debug.slow_step_s: before the step's work, so that the others wait for it in the step's
        first collective, as for a rank late from data loading)."""
        if max(self.fail_at_step, self.hang_at_step, self.hold_at_step) < 0 and not self.slow_step_s:
            return steps

        def steps_with_faults() -> Iterator[int]:
            for step in steps:
                self.maybe_fail(step)
                self.slow_down()
                yield step

        return steps_with_faults()

    def wrap_final_save(self, save: Callable[[int], None], last_step: int) -> Callable[[int], None]:
        """`save(step)`, the run's final checkpoint, preceded by this rank's fault "after the last step"
        (at `last_step` + 1: training.steps + 1)."""
        after = last_step + 1
        if after not in (self.fail_at_step, self.hang_at_step, self.hold_at_step):
            return save

        def save_after_fault(step: int) -> None:
            self.maybe_fail(after)
            save(step)

        return save_after_fault

    def maybe_fail(self, step: int) -> None:
        """Fail, hang or hold `debug.fail_rank` at its step, first attempt only."""
        if step == self.fail_at_step:
            if self.fail_mode == "sigkill":  # a real crash: no Python error, no error file, exit -9
                os.kill(os.getpid(), signal.SIGKILL)
            if self.fail_mode == "input":  # bad input only a worker can see (e.g. a corrupt data window)
                raise InputError(f"injected input error at step {step} (debug.fail_at_step)")
            raise RuntimeError(f"injected failure at step {step} (debug.fail_at_step)")
        if step == self.hang_at_step:
            # A stuck rank: its peers' next collective must time out (launch.timeout_s) and name it. It ends
            # when the launcher stops it, like a process with the default SIGTERM action.
            rank_log(f"hanging at step {step} (debug.hang_at_step)")
            while not preemption.requested():
                time.sleep(0.05)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        if step == self.hold_at_step:
            # Tests signal a run at a known step: this rank waits here, its peers in their next collective.
            rank_log(f"holding at step {step} (debug.hold_at_step)")
            while not preemption.requested():
                time.sleep(0.01)

    def slow_down(self) -> None:
        """A slow rank (debug.slow_step_s): its peers wait for it."""
        if self.slow_step_s:
            time.sleep(self.slow_step_s)

    def wrap_writer(self, make_writer: Callable[[str], Any]) -> Callable[[str], Any]:
        """`make_writer(path)`, the checkpoint's storage writer, whose writes this rank starts
        debug.slow_save_s late (a kill that must land during a save)."""
        if not self.slow_save_s:
            return make_writer
        delay = self.slow_save_s

        def slow_writer(path: str) -> Any:
            writer = make_writer(path)
            write_data = writer.write_data

            def write_data_late(plan: Any, planner: Any) -> Any:
                time.sleep(delay)
                return write_data(plan, planner)

            writer.write_data = write_data_late
            return writer

        return slow_writer

    def wrap_rollout(self, rollout: Any) -> Any:
        """objective=grpo with debug.replay_completions: each rollout's completions read from the file (one
        line per rollout, every rank's rows in dp-rank order) instead of sampled, so that layouts and TRL can
        be compared on the same completions. A row is a list of ids, or with objective.tools a list of turns
        (lists of ids): the first, then each continuation after tool results, which the tools' real results
        precede; a continuation not recorded is generated. The rollout is returned, its two sources of turns
        replaced (`first_turns`, `recorded_turn`)."""
        if rollout is None or not self.replay_completions:
            return rollout
        import json
        from pathlib import Path

        from dtlaunch.infer.batch_generate import Generated

        lines = Path(self.replay_completions).read_text().splitlines()
        recorded = [json.loads(x) for x in lines]
        stops = set(rollout.stop_ids)
        turns: list[list[list[int]]] = []  # this rollout's rows, turn by turn

        def first_turns(model: Any, prompts: list, g: Any, index: int) -> Any:
            lo = rollout.loader.dp_rank * len(prompts)
            rows = recorded[index][lo : lo + len(prompts)]
            turns[:] = [[list(t) for t in r] if r and isinstance(r[0], list) else [list(r)] for r in rows]
            completions = [row[0] for row in turns]
            # Not sampled here: no distribution whose entropy the rollout could report (NaN: none logged).
            return Generated(completions, [not c or c[-1] not in stops for c in completions], float("nan"))

        def recorded_turn(row: int, turn: int) -> Any:
            return turns[row][turn] if turn < len(turns[row]) else None

        rollout.first_turns, rollout.recorded_turn = first_turns, recorded_turn
        return rollout

    def wrap_step(self, step_fn: Callable[..., Any]) -> Callable[..., Any]:
        """`step_fn(rt, batches, step)`, its model parts' outputs NaN at debug.nan_at_steps: the loss and
        every gradient are then non-finite, and the step must be skipped, not applied."""
        if not self.nan_at_steps:
            return step_fn

        def step_with_faults(rt: Any, batches: Any, step: int, *args: Any, **kwargs: Any) -> Any:
            if step not in self.nan_at_steps:
                return step_fn(rt, batches, step, *args, **kwargs)
            hooks = [m.register_forward_hook(_nan_output) for m in rt.model_parts]
            try:
                return step_fn(rt, batches, step, *args, **kwargs)
            finally:
                for h in hooks:
                    h.remove()

        return step_with_faults


def _nan_output(_module: Any, _args: Any, out: Any) -> Any:
    return out * float("nan") if isinstance(out, torch.Tensor) else out
