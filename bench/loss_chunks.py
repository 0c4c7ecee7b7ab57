"""Throughput of the chunked loss (training.loss_chunks=8) against the full-vocabulary loss (=1), in one run.

One process, fp32, the runtime's own `train_step` on fixed random tokens. The runtimes are built in the
same process with the same weights, and their timed blocks alternate (full, chunked, recomputed, then
backwards), so a machine that gets busier or quieter hurts all alike. Time is this process's CPU time (one
thread): on a shared machine, wall time mostly measures the other processes. Per case: tokens/s as the
median over the blocks, and the ratios to the full loss of
- the chunked loss as it runs by default (gradients taken in forward, dtlaunch.train.loss.LinearCrossEntropy:
  the same FLOPs as the full loss);
- the chunks recomputed in backward (a pipeline's last stage): the head's matmul once more per token,
  2·h·V of the step's ~6·P FLOPs per token, shown as "expected cost".

Cases: `llama8b-shaped` has the head's share of Llama-3.1-8B's FLOPs (head / all parameters ~ 6.5 %, so
a recompute cost of ~2 %); `tiny-32k` is the 32k-vocabulary tiny model the planner rows use, where the
head is most of the model (the worst case).

`--preference`: the preference objectives' chunked log-probs (objective=orpo: the policy alone; dpo: a
frozen reference copy's no-grad forward too) against their whole-logits pass, on fixed pairs whose first
half of each row is the prompt. Their chunks are always recomputed in backward.

    python bench/loss_chunks.py [--reps 5] [--steps 4] [--preference] [--markdown FILE] [--json FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import describe_machine, machine_info, markdown_table, this_command, write_json

CASES: dict[str, list[str]] = {
    "llama8b-shaped": ["model=planner7m", "model.vocab_size=1536", "training.micro_batch=4", "training.seq_len=256"],
    "tiny-32k": ["model=tiny", "model.vocab_size=32000", "training.micro_batch=4", "training.seq_len=128"],
}


class FixedPairs:
    """A preference micro-batch as the loader hands it: `pairs` chosen rows above their rejected rows,
    targets -100 over each row's first half (the prompt)."""

    def __init__(self, pairs: int, seq_len: int, vocab: int) -> None:
        import torch

        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, vocab, (2 * pairs, seq_len + 1), generator=g)
        self.inputs, self.targets = tokens[:, :-1], tokens[:, 1:].clone()
        self.targets[:, : seq_len // 2] = -100

    def next_batch(self) -> Any:
        from dtlaunch.train.batch import MicroBatch

        return MicroBatch(self.inputs, self.targets)


class FixedBatches:
    def __init__(self, micro_batch: int, seq_len: int, vocab: int) -> None:
        import torch

        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=g)

    def next_batch(self) -> Any:
        from dtlaunch.train.batch import MicroBatch

        return MicroBatch(self.tokens[:, :-1], self.tokens[:, 1:])


def runtime(overrides: list[str]) -> Any:
    """The single-process runtime (no mesh): the plain model with the worker's init, optimizer and step."""
    import torch

    from dtlaunch.config.decisions import Decisions
    from dtlaunch.config.layout import Layout
    from dtlaunch.job.compose import compose
    from dtlaunch.job.validate import validate
    from dtlaunch.models.registry import model_spec
    from dtlaunch.train.optim import build_optimizer, build_scheduler
    from dtlaunch.train.parallel.init_weights import materialize_and_init
    from dtlaunch.train.runtime import Runtime

    cfg = compose([*overrides, "launch.nproc_per_node=1", "precision=fp32"]).cfg
    validate(cfg)
    device = torch.device("cpu")
    model = model_spec(cfg.model).build(cfg.model, rope_len=int(cfg.training.seq_len), device="meta")
    materialize_and_init(model, device, int(cfg.training.seed), init_source=model)
    opt = build_optimizer(model, cfg, device)
    dec = Decisions.of(cfg, Layout.resolve(cfg.strategy, 1))
    from dtlaunch.train.objectives import build_objective
    from dtlaunch.train.objectives.reference import build_reference

    return Runtime(
        cfg=cfg,
        decisions=dec,
        mesh=None,
        device=device,
        model_parts=[model],
        optimizers=[opt],
        schedulers=[build_scheduler(opt, cfg)],
        objective=build_objective(cfg, dec, None),
        reference=build_reference(cfg, dec, None, [model]),
    )


def expected_cost(cfg: Any) -> float:
    """The recompute's share of a step's FLOPs (the pipeline's chunked loss): 2·h·V per token over the
    model's training FLOPs. The fused chunked loss has no extra FLOPs."""
    from dtlaunch.models.registry import model_spec

    m = cfg.model
    return 2 * m.dim * m.vocab_size / model_spec(m).flops_per_token(m, int(cfg.training.seq_len))


def bench_case(name: str, overrides: list[str], reps: int, steps: int) -> dict:
    from dtlaunch.train.step import train_step

    rts = {n: runtime([*overrides, f"training.loss_chunks={n}"]) for n in (1, 8)}
    rts[-8] = runtime([*overrides, "training.loss_chunks=8"])
    rts[-8].loss_fn.fused = False  # each chunk recomputed in backward, as on a pipeline's last stage
    modes = (1, 8, -8)
    t = rts[1].cfg.training
    data = FixedBatches(int(t.micro_batch), int(t.seq_len), int(rts[1].cfg.model.vocab_size))
    tokens = int(t.micro_batch) * int(t.seq_len) * steps
    for rt in rts.values():  # warm-up: allocator, first optimizer step (state creation)
        for s in range(2):
            train_step(rt, data, s + 1)
    rates: dict[int, list[float]] = {n: [] for n in modes}
    losses: dict[int, float] = {}
    for rep in range(reps):
        for n in modes if rep % 2 == 0 else modes[::-1]:
            start = time.process_time()
            for s in range(steps):
                r = train_step(rts[n], data, 3 + rep * steps + s)
            rates[n].append(tokens / (time.process_time() - start))
            losses[n] = float(r.local_loss)
    full, chunked, remat = (statistics.median(rates[n]) for n in modes)
    row = {
        "case": name,
        "overrides": overrides,
        "tokens_per_s_full": full,
        "tokens_per_s_chunked": chunked,
        "tokens_per_s_recompute": remat,
        "ratio": chunked / full,
        "ratio_recompute": remat / full,
        "expected_cost": expected_cost(rts[1].cfg),
        "rates": rates,
        "last_loss": losses,
    }
    print(
        f"{name:16s} full {full:9.0f} tok/s  chunked(8) {chunked:9.0f} tok/s  ratio {chunked / full:.3f}  "
        f"recomputed(8) ratio {remat / full:.3f} (expected cost {row['expected_cost'] * 100:.1f} %)",
        flush=True,
    )
    return row


PREFERENCE = {
    "orpo-llama8b-shaped": [*CASES["llama8b-shaped"], "objective=orpo", "data.kind=synthetic"],
    "dpo-llama8b-shaped": [*CASES["llama8b-shaped"], "objective=dpo", "data.kind=synthetic"],
    "orpo-tiny-32k": [*CASES["tiny-32k"], "objective=orpo", "data.kind=synthetic"],
}


def bench_preference(name: str, overrides: list[str], reps: int, steps: int) -> dict:
    """Chunked (8, recomputed) against whole-logits (1) preference log-probs, alternating blocks."""
    from dtlaunch.train.step import train_step

    rts = {n: runtime([*overrides, f"training.loss_chunks={n}"]) for n in (1, 8)}
    t = rts[1].cfg.training
    data = FixedPairs(int(t.micro_batch), int(t.seq_len), int(rts[1].cfg.model.vocab_size))
    tokens = 2 * int(t.micro_batch) * int(t.seq_len) * steps
    for rt in rts.values():
        for s in range(2):
            train_step(rt, data, s + 1)
    rates: dict[int, list[float]] = {1: [], 8: []}
    losses: dict[int, float] = {}
    for rep in range(reps):
        for n in (1, 8) if rep % 2 == 0 else (8, 1):
            start = time.process_time()
            for s in range(steps):
                r = train_step(rts[n], data, 3 + rep * steps + s)
            rates[n].append(tokens / (time.process_time() - start))
            losses[n] = float(r.local_loss)
    full, chunked = statistics.median(rates[1]), statistics.median(rates[8])
    row = {
        "case": name,
        "overrides": overrides,
        "tokens_per_s_full": full,
        "tokens_per_s_chunked": chunked,
        "ratio": chunked / full,
        "expected_cost": expected_cost(rts[1].cfg),
        "rates": rates,
        "last_loss": losses,
    }
    print(
        f"{name:20s} full {full:9.0f} tok/s  chunked(8) {chunked:9.0f} tok/s  ratio {chunked / full:.3f}  "
        f"(expected cost {row['expected_cost'] * 100:.1f} %)  last loss {losses[1]:.6f} / {losses[8]:.6f}",
        flush=True,
    )
    return row


def preference_markdown(rows: list[dict], info: dict, args: Any) -> str:
    table = markdown_table(
        ["case", "overrides", "whole logits tok/s", "chunked (8) tok/s", "chunked / whole", "expected cost"],
        [
            [
                r["case"],
                " ".join(r["overrides"]),
                f"{r['tokens_per_s_full']:.0f}",
                f"{r['tokens_per_s_chunked']:.0f}",
                f"{r['ratio']:.3f}",
                f"{r['expected_cost'] * 100:.1f} %",
            ]
            for r in rows
        ],
    )
    return "\n".join(
        [
            "# Preference objectives: chunked log-probs (training.loss_chunks=8) vs whole logits (=1), CPU",
            "",
            f"- machine: {describe_machine(info)}",
            f"- command: `{this_command()}`",
            f"- one process, one thread, fp32; {args.reps} alternating blocks of {args.steps} steps per mode "
            "(median rows x tokens per CPU-second of the process); the same weights and pairs in both modes",
            "- the chunks are recomputed in backward (a row's gradient waits for every row's sum): one more "
            "head matmul per token for the policy, none for DPO's no-grad reference forward",
            "",
            table,
            "",
        ]
    )


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--markdown", type=Path)
    p.add_argument("--json", type=Path)
    p.add_argument("--preference", action="store_true", help="the preference objectives' log-probs instead")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # one core: the ratio is not a measure of how busy the other core is
    info = machine_info()
    if args.preference:
        prefs = [bench_preference(n, ov, args.reps, args.steps) for n, ov in PREFERENCE.items()]
        if args.json:
            write_json(args.json, {"machine": info, "command": this_command(), "rows": prefs})
        if args.markdown:
            args.markdown.parent.mkdir(parents=True, exist_ok=True)
            args.markdown.write_text(preference_markdown(prefs, info, args))
        return
    rows = [bench_case(n, ov, args.reps, args.steps) for n, ov in CASES.items()]
    if args.json:
        write_json(args.json, {"machine": info, "command": this_command(), "rows": rows})
    if args.markdown:
        table = markdown_table(
            [
                "case",
                "overrides",
                "full tok/s",
                "chunked (8) tok/s",
                "chunked / full",
                "recomputed chunks (pipeline) / full",
                "recompute's expected cost (2hV / FLOPs per token)",
            ],
            [
                [
                    r["case"],
                    " ".join(r["overrides"]),
                    f"{r['tokens_per_s_full']:.0f}",
                    f"{r['tokens_per_s_chunked']:.0f}",
                    f"{r['ratio']:.3f}",
                    f"{r['ratio_recompute']:.3f}",
                    f"{r['expected_cost'] * 100:.1f} %",
                ]
                for r in rows
            ],
        )
        text = [
            "# Chunked loss throughput (training.loss_chunks=8, fused and recomputed, vs 1), CPU",
            "",
            f"- machine: {describe_machine(info)}",
            f"- command: `{this_command()}`",
            f"- one process, one thread, fp32; {args.reps} alternating blocks of {args.steps} steps per mode "
            "(median tokens per CPU-second of the process); same weights and tokens in both modes",
            "",
            table,
            "",
        ]
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text("\n".join(text))


if __name__ == "__main__":
    main(sys.argv[1:])
