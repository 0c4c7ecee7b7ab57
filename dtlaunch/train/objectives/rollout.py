"""objective=grpo's rollout, read here top to bottom: `rollout_data` (at the end) is GRPOObjective's
(dtlaunch.train.objectives.grpo) `step_data`: the prompts and this rollout, run before each optimizer step:
this data-parallel rank's prompts -> G sampled completions each (dtlaunch.infer.batch_generate, with the
policy being trained) -> rewards (objective.rewards) -> advantages over the whole generation batch -> the
rows the step trains on; GRPOObjective's `step_loss` is then the micro-batch's loss on those rows.

A rollout serves objective.num_iterations optimizer steps (TRL's mu); with mu > 1 the old policy's per-token
log-probs are computed once right after generation (no grad, micro-batch by micro-batch) and every step's
ratio is taken against them; with mu = 1 the ratio is exactly 1 (TRL's detached current log-probs).
With objective.beta > 0 the reference's per-token log-probs are computed at the same time.

Prompt order: a seeded permutation per epoch of the prepared prompts (dtlaunch.data.prompts); rollout k
takes the global positions k*P .. (k+1)*P (P = global_batch / G prompts), rank r its slice. Sampling draws
from a generator seeded by (training.seed, rollout index, dp rank): a resumed run regenerates the same
completions from the same weights.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from dtlaunch.data.prompts import META_FILE, PROMPTS_FILE
from dtlaunch.data.sources import TAG_ORDER
from dtlaunch.data.tokenizer import load_tokenizer
from dtlaunch.data.tool_chat import tool_loop
from dtlaunch.errors import InputError
from dtlaunch.infer.batch_generate import Generated, Sampling, generate_batch, round_up
from dtlaunch.inputs.rewards import Reward, call_reward, load_rewards, user_rewards
from dtlaunch.inputs.tools import (
    ToolRunner,
    check_environments,
    environment_keys,
    environment_reward_columns,
    environment_rewards,
    load_tools,
    reset_prompts,
    rollout_instances,
)
from dtlaunch.run.run_dir import RunDir
from dtlaunch.train.batch import MicroBatch, RolloutRows
from dtlaunch.train.data import IGNORE_INDEX as IGNORE
from dtlaunch.train.objectives.grpo import (
    advantages,
    combine_rewards,
    importance_sampling_ratio,
    token_logps,
)
from dtlaunch.train.objectives.reference import grpo_reference
from dtlaunch.train.objectives.step_data import StepData
from dtlaunch.train.parallel.generation_gather import gathered_for_generation
from dtlaunch.train.parallel.parallelize import compute_context

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

PAD = 0
TAG_ROLLOUT = 0x6A90  # the sampling generator's seed tag


class PromptLoader:
    """The prepared prompts in a seeded order; its state is the global position (any dp size resumes it)."""

    def __init__(self, run_dir: Path, seed: int, dp_rank: int, dp_size: int) -> None:
        lines = (run_dir / PROMPTS_FILE).read_text().splitlines()
        self.records = [json.loads(line) for line in lines if line.strip()]
        self.meta = json.loads((run_dir / META_FILE).read_text())
        self.seed, self.dp_rank, self.dp_size = seed, dp_rank, dp_size
        self.consumed = 0

    def _index(self, position: int) -> int:
        n = len(self.records)
        perm = np.random.default_rng([self.seed, TAG_ORDER, position // n]).permutation(n)
        return int(perm[position % n])

    def next_prompts(self, global_prompts: int) -> list[dict]:
        """This rank's share of the next `global_prompts` prompts; advances the global position."""
        per_rank = global_prompts // self.dp_size
        start = self.consumed + self.dp_rank * per_rank
        self.consumed += global_prompts
        return [self.records[self._index(p)] for p in range(start, start + per_rank)]

    def state_dict(self) -> dict[str, Any]:
        return {"consumed_prompts": self.consumed, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consumed = int(state["consumed_prompts"])


@dataclass
class RolloutBatches:
    """One rollout's rows, handed to train_step as its micro-batches (`next_batch`), each with the per-row
    values the GRPO objective reads (MicroBatch.rollout)."""

    inputs: torch.Tensor  # (rows, seq)
    targets: torch.Tensor  # (rows, seq): completion tokens, -100 elsewhere (and on masked truncated rows)
    adv: torch.Tensor  # (rows,)
    step_tokens_per_rank: torch.Tensor  # the generation batch's loss tokens over all ranks / dp
    micro_batch: int
    old: Optional[torch.Tensor] = None  # (rows, seq) old-policy log-probs (num_iterations > 1)
    ref: Optional[torch.Tensor] = None  # (rows, seq) reference log-probs (beta > 0)
    is_ratio: Optional[torch.Tensor] = None  # (rows, seq | 1) the sampler correction's weights
    metrics: dict[str, float] = field(default_factory=dict)
    cursor: int = 0

    def rewind(self) -> None:
        self.cursor = 0

    def next_batch(self) -> MicroBatch:
        sl = slice(self.cursor, self.cursor + self.micro_batch)
        self.cursor += self.micro_batch
        rows = RolloutRows(
            adv=self.adv[sl],
            step_tokens=self.step_tokens_per_rank,
            old=self.old[sl] if self.old is not None else None,
            ref=self.ref[sl] if self.ref is not None else None,
            is_ratio=self.is_ratio[sl] if self.is_ratio is not None else None,
        )
        return MicroBatch(self.inputs[sl], self.targets[sl], rollout=rows)


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """DDP's wrapper prepares a gradient reduction on forward; generation runs the wrapped module."""
    return getattr(model, "module", model)


class Rollout:
    def __init__(
        self, cfg: JobConfig, rt: Any, run_dir: Path, loader: PromptLoader, dp_size: int, ref_model: Any = None
    ):
        o, t = cfg.objective, cfg.training
        self.cfg, self.rt, self.run_dir, self.loader, self.ref_model = cfg, rt, run_dir, loader, ref_model
        self.g, self.mu, self.beta = int(o.num_generations), int(o.num_iterations), float(o.beta)
        self.scale, self.mask_truncated = str(o.scale_rewards), bool(o.mask_truncated_completions)
        self.tools = load_tools([str(x) for x in o.tools]) if list(o.tools) else []
        self.envs = check_environments(o, self.tools)
        # The user's code (tools, environments, reward functions) runs in a child process of this rank, with a
        # timeout and a memory limit (objective.tool_timeout_s 0: in this process, unguarded).
        timeout = float(o.tool_timeout_s)
        remote = user_rewards(o) if timeout > 0 else []
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.tool_runner: Optional[ToolRunner] = None
        if self.tools or self.envs or remote:
            # Peers wait in a collective for this rank's calls: half their timeout is the calls' share.
            budget = float(cfg.launch.timeout_s) / 2 if world > 1 else 0.0
            self.tool_runner = ToolRunner(
                self.tools, timeout, self.envs, remote, int(o.tool_memory_mb), round_budget_s=budget
            )
        self.rewards = load_rewards(o, self._remote_reward if remote else None)
        self._env_keys: list[str] = []  # this rollout's rows' environments and instances
        self._env_instances: list[str] = []
        for env in environment_reward_columns(self.envs):  # TRL: weight 1, named after the class
            self.rewards.append(Reward(env.cls.__name__, self._env_reward(env), 1.0))
        self.weights = torch.tensor([r.weight for r in self.rewards])
        self.sampling = Sampling(int(o.max_completion_length), float(o.temperature), float(o.top_p), int(o.top_k))
        self.seq_len, self.micro_batch, self.seed = int(t.seq_len), int(t.micro_batch), int(t.seed)
        self.global_prompts = rt.accum * self.micro_batch * dp_size // self.g
        self.dp_size = dp_size
        self.stop_ids = list(loader.meta["stop_ids"])
        self.tokenizer = load_tokenizer(str(RunDir(run_dir).tokenizer))
        self.current: Optional[RolloutBatches] = None
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.max_tool_iterations = o.max_tool_calling_iterations
        self.is_correction = bool(o.importance_sampling_correction)
        # The job's decisions (config.decisions), as the planner sized them.
        self.keeps_old = rt.decisions.keeps_old_logps
        self.gather_whole = rt.decisions.generation_gather != "unit"
        self.positions_multiple = rt.decisions.decode_positions_multiple
        self.compiled = bool(o.generation_compile)
        with_tools = bool(self.tools or self.envs)
        self.chat = None
        if with_tools:
            from dtlaunch.data.prompts import PromptEncoder, tool_chat

            schemas = [t.schema for t in self.tools] + [t.schema for e in self.envs for t in e.tools]
            self.encoder = PromptEncoder(RunDir(run_dir).tokenizer, "", schemas)
            self.chat = tool_chat(self.encoder, self.stop_ids)
            self.env_schemas = {e.key: [t.schema for t in self.tools + e.tools] for e in self.envs}
        self.prompt_limit = int(t.seq_len) - int(o.max_completion_length)

    def _remote_reward(self, spec: str) -> Any:
        def reward(prompts: Any, completions: Any, completion_ids: Any, **columns: Any) -> list:
            assert self.tool_runner is not None
            return self.tool_runner.score(spec, prompts, completions, completion_ids, columns)

        return reward

    def _env_reward(self, env: Any) -> Any:
        def reward(prompts: Any, completions: Any, completion_ids: Any, **_: Any) -> list:
            assert self.tool_runner is not None
            return environment_rewards(self.tool_runner, env, self.envs, self._env_keys, self._env_instances)

        return reward

    def _reset_environments(self, prompts: list[dict]) -> list[dict]:
        """TRL: one instance per rollout, reset with its record; the prompt (with reset's text) encoded again
        with its environment's tools."""
        assert self.tool_runner is not None
        columns = [p["columns"] for p in prompts]
        self._env_keys = environment_keys(self.envs, columns)
        self._env_instances = rollout_instances(self._env_keys)
        messages = reset_prompts(
            self.tool_runner, self._env_keys, self._env_instances, [p["prompt"] for p in prompts], columns
        )
        out = []
        for key, p, m in zip(self._env_keys, prompts, messages, strict=True):
            self.encoder.tools = self.env_schemas[key] or None
            ids = self.encoder.encode(m, "a reset prompt")
            if len(ids) > self.prompt_limit:
                raise InputError(
                    f"objective.environment: a prompt with reset's text is {len(ids)} tokens, more than "
                    f"training.seq_len - objective.max_completion_length = {self.prompt_limit}: raise "
                    f"training.seq_len or return less from reset"
                )
            out.append({**p, "prompt": m, "ids": ids})
        return out

    def batches(self, step: int) -> RolloutBatches:
        """The rows of optimizer step `step` (1-based): a new rollout every num_iterations steps."""
        index = (step - 1) // self.mu
        if self.current is None or (step - 1) % self.mu == 0:
            self.loader.consumed = index * self.global_prompts  # resumable from the step alone
            self.current = self._rollout(step, index)
        else:
            self.current.metrics = {}  # logged once, with the step that generated them
        self.current.rewind()
        return self.current

    def close(self) -> None:
        """The user-code process and whatever it started (its process group) killed: a tool that left a process
        running in the background must not outlive the run (the process itself would die with this worker)."""
        if self.tool_runner is not None:
            self.tool_runner.close()

    def last_step_of_batch(self, step: int) -> bool:
        """Whether `step` is its generation batch's last optimizer step: the only steps a checkpoint may follow
        (checkpoint.every_steps is a multiple of num_iterations; a preemption stop waits for one), since a
        resume regenerates from the weights at a batch's first step."""
        return step % self.mu == 0

    def _rollout(self, step: int, index: int) -> RolloutBatches:
        rt = self.rt
        began = time.perf_counter()
        records = self.loader.next_prompts(self.global_prompts)
        prompts = [r for r in records for _ in range(self.g)]  # each prompt's G completions side by side
        runner_counts = (0, 0)
        if self.tool_runner is not None:
            self.tool_runner.new_round()
            runner_counts = (self.tool_runner.timeouts, self.tool_runner.restarts)
        if self.envs:
            prompts = self._reset_environments(prompts)
        g = torch.Generator(device=rt.device).manual_seed(
            (self.seed * 1_000_003 + TAG_ROLLOUT + index * 7_919 + self.loader.dp_rank * 104_729) % (2**63)
        )
        model = _unwrapped(rt.model_parts[0])
        gen = self.first_turns(model, prompts, g, index)
        chat = not isinstance(prompts[0]["prompt"], str)
        tool_mask, tool_stats = None, None
        if self.chat is not None:
            turns, sampled = self._tool_turns(model, prompts, gen, g)
            logps = sampled_logps(sampled, turns.tool_mask) if sampled is not None else None
            ended = [not c or c[-1] not in self.stop_ids for c in turns.completion_ids]
            gen = Generated(turns.completion_ids, ended, gen.entropy, logps)
            tool_mask, tool_stats = turns.tool_mask, (turns.calls, turns.failures)
        gen_s = time.perf_counter() - began
        texts = [self.tokenizer.decode([i for i in c if i not in self.stop_ids]) for c in gen.completions]
        completions: list[Any] = [[{"role": "assistant", "content": x}] for x in texts] if chat else texts
        if self.chat is not None:
            completions = turns.completions  # TRL's: the parsed assistant turns and the tool messages
        keys = sorted({k for p in prompts for k in p["columns"]})
        columns = {k: [p["columns"].get(k) for p in prompts] for k in keys}
        originals = [p["prompt"] for p in prompts]
        if self.tool_runner is not None:  # the rewards run after the tool rounds' last collective
            self.tool_runner.new_round()
        per_func = torch.tensor(
            [call_reward(r, originals, completions, gen.completions, columns) for r in self.rewards],
            dtype=torch.float32,
        ).T.reshape(len(prompts), len(self.rewards))
        everyone = self._gather(per_func)  # (all rows, F) in dp-rank order
        adv_all = advantages(everyone, self.weights, self.g, self.scale)
        lo = self.loader.dp_rank * len(prompts)
        adv = adv_all[lo : lo + len(prompts)]
        inputs, targets = self._rows([p["ids"] for p in prompts], gen.completions, gen.truncated, tool_mask)
        local_tokens = (targets != IGNORE).sum().float()
        step_tokens = self._sum(local_tokens.clone()) / self.dp_size
        batches = RolloutBatches(
            inputs.to(rt.device),
            targets.to(rt.device),
            adv.to(rt.device),
            step_tokens.to(rt.device),
            self.micro_batch,
        )
        # The correction compares the sampler with the training policy as it stands (TRL computes the old
        # policy's log-probs for it whatever num_iterations is), so the loss's ratio uses them too.
        batches.old = self._logps(model, batches) if self.keeps_old else None
        batches.ref = self._logps(None, batches) if self.beta > 0 else None
        if self.is_correction:
            assert batches.old is not None
            sampled = sampler_rows(
                [p["ids"] for p in prompts], gen.completions, gen.logps, self.seq_len, inputs.shape[1]
            )
            correction = self._correct(batches, sampled.to(rt.device))
        # As TRL: a completion's length counts the model's tokens, not the tool results'.
        counts = [sum(m) for m in tool_mask] if tool_mask is not None else [len(c) for c in gen.completions]
        lengths = torch.tensor(counts, dtype=torch.float32)
        batches.metrics = self._metrics(everyone, lengths, gen.truncated, gen_s, time.perf_counter() - began)
        if self.is_correction:
            batches.metrics.update(correction)
        if tool_stats is not None:
            assert self.tool_runner is not None
            timeouts = self.tool_runner.timeouts - runner_counts[0]
            restarts = self.tool_runner.restarts - runner_counts[1]
            stats = [float(tool_stats[0]), float(tool_stats[1]), float(timeouts), float(restarts)]
            calls, failures, timeouts, restarts = self._sum(torch.tensor(stats)).tolist()
            batches.metrics["tools/call_frequency"] = calls / (len(prompts) * self.dp_size)
            batches.metrics["tools/failure_frequency"] = failures / calls if calls > 0 else 0.0
            # Counts over every rank: failed calls (all causes), those past their time, processes replaced.
            batches.metrics["tools/failures"] = failures
            batches.metrics["tools/timeouts"] = timeouts
            batches.metrics["tools/restarts"] = restarts
        if not math.isnan(gen.entropy):  # (NaN: turns not sampled here, debug.replay_completions)
            batches.metrics["entropy"] = gen.entropy
        if self.rank == 0:
            self._write_sample(step, originals, texts, everyone[: len(prompts)], adv)
        return batches

    def first_turns(self, model: torch.nn.Module, prompts: list[dict], g: torch.Generator, index: int) -> Generated:
        """Rollout `index`'s completions (their first turns, before any tool result): sampled by the policy.
        (debug.replay_completions, a test hook, puts recorded ones in its place: Faults.wrap_rollout.)"""
        return self._generate(model, prompts, g)

    def recorded_turn(self, row: int, turn: int) -> Optional[list[int]]:
        """A continuation turn known in advance for this row (None: generated; replayed runs record some)."""
        return None

    def _generate(self, model: torch.nn.Module, prompts: list[dict], g: torch.Generator) -> Generated:
        whole = self.gather_whole
        with compute_context(self.rt.model_parts, self.cfg, self.rt.device), gathered_for_generation(model, whole):
            ids = [p["ids"] for p in prompts]
            multiple, compiled = self.positions_multiple, self.compiled
            return generate_batch(
                model,
                ids,
                self.sampling,
                self.stop_ids,
                PAD,
                g,
                self._all_done,
                multiple,
                compiled,
                sampler_logps=self.is_correction,
            )

    def _tool_turns(
        self, model: torch.nn.Module, prompts: list[dict], gen: Generated, g: torch.Generator
    ) -> tuple[Any, Optional[list[list[float]]]]:
        """The completions' tool calls run and generation continued (dtlaunch.data.tool_chat.tool_loop); with
        the sampler correction, each row's sampler log-probs, turn after turn."""
        assert self.chat is not None and self.tool_runner is not None

        # objective.importance_sampling_correction: each row's sampler log-probs, the first turn's and then
        # each continuation's (sampled_logps lays them over the model's tokens of the multi-turn completion);
        # a replayed turn has none (NaN: no correction).
        sampled = None
        if self.is_correction:
            sampled = [list(x) for x in gen.logps or [[float("nan")] * len(c) for c in gen.completions]]

        def generated(rows: list[int], seqs: list[list[int]], limits: list[int], turn: int) -> list[list[int]]:
            # Every row's turn not known in advance is generated (every rank takes part).
            known = [self.recorded_turn(i, turn) for i in rows]
            live = [k for k, ids in enumerate(known) if ids is None]
            # A row's prompt is the prefix its group's rows share: prefilled once per prompt (generate_batch).
            shared = [len(prompts[rows[k]]["ids"]) for k in live]
            ids, logps = self._continue(model, [seqs[k] for k in live], [limits[k] for k in live], g, shared)
            made = dict(zip(live, ids, strict=True))
            scored = dict(zip(live, logps, strict=True)) if logps is not None else {}
            out = []
            for k, i in enumerate(rows):
                turn_ids = made[k] if k in made else known[k]
                if sampled is not None:  # tool_loop keeps each row's first `limit` new tokens
                    sampled[i] += scored.get(k, [float("nan")] * len(turn_ids))[: limits[k]]
                out.append(turn_ids)
            return out

        turns = tool_loop(
            self.chat,
            self.tool_runner,
            [p["ids"] for p in prompts],
            gen.completions,
            generated,
            self.sampling.max_new_tokens,
            None if self.max_tool_iterations is None else int(self.max_tool_iterations),
            any_left=self._any_rank,
            instances=self._env_instances if self.envs else None,
        )
        return turns, sampled

    def _continue(
        self, model: torch.nn.Module, seqs: list[list[int]], limits: list[int], g: Any, shared: list[int]
    ) -> tuple[list[list[int]], Optional[list[list[float]]]]:
        """One continuation turn of the rows that called tools. Ranks generate together (see _all_done), so
        they agree on the longest limit; a rank without such rows decodes one stand-in row, ended at once."""
        longest = max(limits, default=0)
        if dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([longest], device=self.rt.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            longest = int(t)
        if longest == 0:  # no rank has a row to continue with room left
            return [[] for _ in seqs], [[] for _ in seqs]
        rows, caps, prefixes = (seqs, limits, shared) if seqs else ([[PAD]], [1], None)
        caps = [max(c, 1) for c in caps]  # a row with no room: one token, cut away by tool_loop
        sampling = Sampling(longest, self.sampling.temperature, self.sampling.top_p, self.sampling.top_k)
        whole = self.gather_whole
        with compute_context(self.rt.model_parts, self.cfg, self.rt.device), gathered_for_generation(model, whole):
            multiple = self.positions_multiple
            out = generate_batch(
                model,
                rows,
                sampling,
                self.stop_ids,
                PAD,
                g,
                self._all_done,
                multiple,
                False,
                limits=caps,
                sampler_logps=self.is_correction,
                shared=prefixes,
            )
        return (out.completions, out.logps) if seqs else ([], [])

    def _any_rank(self, mine: bool) -> bool:
        """Whether any data-parallel rank still has rows calling tools (every rank then keeps generating)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return mine
        t = torch.tensor([int(mine)], device=self.rt.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if self.tool_runner is not None:  # the calls until the next collective share a new budget
            self.tool_runner.new_round()
        return bool(int(t))

    def _rows(
        self, prompts: list, completions: list, truncated: list, tool_mask: Optional[list] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return training_rows(
            prompts, completions, truncated, tool_mask, self.seq_len, self.mask_truncated, self.positions_multiple
        )

    @torch.no_grad()
    def _logps(self, model: Any, b: RolloutBatches) -> torch.Tensor:
        """Per-token log-probs of the rows' targets under `model` (None: the reference), micro-batch by
        micro-batch (no grad)."""
        rt, out = self.rt, []
        for i in range(0, b.inputs.shape[0], self.micro_batch):
            x, y = b.inputs[i : i + self.micro_batch], b.targets[i : i + self.micro_batch]
            with rt.loss_context(), compute_context(rt.model_parts, self.cfg, rt.device):
                if model is None:  # the reference (objective.beta > 0)
                    out.append(self.ref_model(x, y))
                else:
                    out.append(
                        token_logps(
                            rt.loss_fn.model_output(model, x), y, rt.loss_fn.token_nll, self.sampling.temperature
                        )
                    )
        return torch.cat(out)

    def _correct(self, b: RolloutBatches, sampled: torch.Tensor) -> dict[str, float]:
        """objective.importance_sampling_correction: the rows' weights (b.is_ratio) and TRL's metrics of how far
        the sampler's log-probs are from the training policy's, over every rank."""
        assert b.old is not None
        o = self.cfg.objective
        mask = (b.targets != IGNORE).float()
        b.is_ratio = importance_sampling_ratio(
            b.old,
            sampled,
            mask,
            str(o.importance_sampling_mode),
            float(o.importance_sampling_clip_min),
            float(o.importance_sampling_clip_max),
        )
        delta = (b.old - sampled).abs()[(mask > 0) & ~torch.isnan(sampled)]
        ratio = b.is_ratio.flatten() if b.is_ratio.shape[-1] == 1 else b.is_ratio[mask > 0]
        zero = torch.zeros((), device=mask.device)
        stats = torch.stack(
            [
                delta.sum() if delta.numel() else zero,
                torch.tensor(float(delta.numel()), device=mask.device),
                ratio.sum() if ratio.numel() else zero,
                torch.tensor(float(ratio.numel()), device=mask.device),
            ]
        )
        extremes = torch.stack(
            [
                delta.max() if delta.numel() else zero,
                ratio.max() if ratio.numel() else zero,
                -ratio.min() if ratio.numel() else zero,
            ]
        )
        total = self._sum(stats)
        if dist.is_initialized():
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        d_sum, d_n, r_sum, r_n = total.tolist()
        d_max, r_max, r_min = extremes.tolist()
        return {
            "sampling/sampling_logp_difference/mean": d_sum / d_n if d_n else 0.0,
            "sampling/sampling_logp_difference/max": d_max,
            "sampling/importance_sampling_ratio/min": -r_min,
            "sampling/importance_sampling_ratio/mean": r_sum / r_n if r_n else 0.0,
            "sampling/importance_sampling_ratio/max": r_max,
        }

    def _all_done(self, done: torch.Tensor) -> bool:
        """Every rank's rows finished: all ranks decode the same number of steps (one small all-reduce per
        step; none with one process), so that a rank's forwards never wait on a collective of a rank that
        stopped (FSDP's gather of a unit the prefill did not reach, MoE's expert exchange)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return bool(done.all())
        unfinished = (~done).sum().reshape(1).to(self.rt.device)
        dist.all_reduce(unfinished)
        return int(unfinished) == 0

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every data-parallel rank's rows, in dp-rank order (TP / CP peers hold the same rows)."""
        if not dist.is_initialized() or self.dp_size == 1:
            return t
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (self.loader.dp_rank, t))
        by_rank = dict(parts)
        return torch.cat([by_rank[r] for r in range(self.dp_size)])

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over data-parallel ranks of a value every TP / CP peer holds alike."""
        if not dist.is_initialized() or self.dp_size == 1:
            return t
        world = dist.get_world_size()
        out = t.to(self.rt.device)
        dist.all_reduce(out)
        return (out * self.dp_size / world).cpu()

    def _metrics(self, per_func: torch.Tensor, lengths: torch.Tensor, truncated: list, gen_s: float, roll_s: float):
        rewards = combine_rewards(per_func, self.weights)
        m = {
            "reward": float(torch.nanmean(rewards)),
            "reward_std": float(_std(rewards)),
            "completions/mean_length": float(lengths.mean()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float(np.mean(truncated)),
            "time/generation_s": gen_s,
            "time/rollout_s": roll_s,
            "generated_tokens_per_s": float(lengths.sum()) / max(gen_s, 1e-9),
        }
        for i, r in enumerate(self.rewards):
            col = per_func[:, i]
            m[f"rewards/{r.name}/mean"] = float(torch.nanmean(col)) if not torch.isnan(col).all() else math.nan
            m[f"rewards/{r.name}/std"] = float(_std(col))
        return m

    def _write_sample(self, step: int, prompts: list, texts: list, per_func: torch.Tensor, adv: torch.Tensor) -> None:
        out = self.run_dir / "completions" / f"step-{step}.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w") as fh:
            for i in range(min(len(texts), 2 * self.g)):
                rewards = {r.name: _finite(float(per_func[i, j])) for j, r in enumerate(self.rewards)}
                row = {"prompt": prompts[i], "completion": texts[i], "rewards": rewards, "advantage": float(adv[i])}
                fh.write(json.dumps(row) + "\n")


def row_width(prompts: list, completions: list, seq_len: int, multiple: int = 1) -> int:
    """The training rows' width: the longest prompt + completion's inputs (cut at seq_len), rounded up to
    `multiple` (sequence parallel's positions, decode_positions_multiple). As TRL pads to the batch's longest:
    a row padded to seq_len would cost the forward, backward and log-prob passes its padding (30-40 % of a
    step whose completions end early). Causal attention keeps a token's values apart from the padding after
    it, so the loss is the same as at full width."""
    longest = max((len(p) + len(c) - 1 for p, c in zip(prompts, completions, strict=True)), default=1)
    return min(round_up(max(longest, 1), multiple), seq_len)


def training_rows(
    prompts: list,
    completions: list,
    truncated: list,
    tool_mask: Optional[list],
    seq_len: int,
    mask_truncated: bool,
    multiple: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Training rows: prompt + completion from position 0, right-padded to row_width; targets are the
    completion's, but for the tool results' tokens (tool_mask 0: the model did not write them) and, with
    mask_truncated, a truncated completion's."""
    width = row_width(prompts, completions, seq_len, multiple)
    # Built as lists and made tensors once: a tensor per row cost a few operator calls each (~1 ms a step
    # for 32 rows on CPU).
    inputs, targets = [], []
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        seq = (list(p) + list(c))[: seq_len + 1]
        inputs.append(seq[:-1] + [PAD] * (width - len(seq) + 1))
        row = [IGNORE] * width
        if not (mask_truncated and truncated[i]):
            target = seq[len(p) :]
            if tool_mask is not None:
                keep = tool_mask[i][: len(target)]
                target = [t if k else IGNORE for t, k in zip(target, keep, strict=True)]
            row[len(p) - 1 : len(seq) - 1] = target
        targets.append(row)
    return torch.tensor(inputs, dtype=torch.long), torch.tensor(targets, dtype=torch.long)


def sampled_logps(per_turn: list[list[float]], tool_mask: list[list[int]]) -> list[list[float]]:
    """Each row's sampler log-probs (its turns' in order) laid over its multi-turn completion: the model's
    tokens (tool_mask 1) take them one by one, the tool results' tokens (0) get NaN (never sampled)."""
    out = []
    for values, mask in zip(per_turn, tool_mask, strict=True):
        it = iter(values)
        out.append([next(it, float("nan")) if m else float("nan") for m in mask])
    return out


def sampler_rows(prompts: list, completions: list, logps: Optional[list], seq_len: int, width: int) -> torch.Tensor:
    """(rows, width) the sampler's log-prob of each completion token, where training_rows puts its target;
    NaN elsewhere, and everywhere when the completions were not sampled (replayed: `logps` None)."""
    out = torch.full((len(prompts), width), float("nan"))
    if logps is None:
        return out
    for i, (p, c, lp) in enumerate(zip(prompts, completions, logps, strict=True)):
        n = min(len(c), seq_len + 1 - len(p))  # training_rows cuts prompt + completion at seq_len + 1
        if n > 0:
            out[i, len(p) - 1 : len(p) - 1 + n] = torch.tensor(lp[:n])
    return out


def _std(t: torch.Tensor) -> torch.Tensor:
    t = t[~torch.isnan(t)]
    return t.std() if t.numel() > 1 else torch.tensor(0.0)


def _finite(x: float) -> Optional[float]:
    return x if math.isfinite(x) else None


def rollout_data(cfg: JobConfig, run_dir: Path, rt: Any, dp_rank: int, dp_size: int) -> StepData:
    """objective=grpo's step data: the prompts, and the rollout that turns them into each step's rows
    (generation, rewards, advantages); the step's loss on those rows is GRPOObjective's
    (dtlaunch.train.objectives.grpo)."""
    loader = PromptLoader(run_dir, int(cfg.training.seed), dp_rank, dp_size)
    reference = grpo_reference(cfg, rt.decisions, rt.mesh, rt.model_parts)
    return StepData(loader, None, Rollout(cfg, rt, run_dir, loader, dp_size, reference))
