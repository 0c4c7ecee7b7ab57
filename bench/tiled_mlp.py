"""Throughput of the tiled MLP (training.mlp_tiles, dtlaunch.train.features.tiled_mlp) against the untiled MLP, in
one run.

One process, fp32, full activation checkpointing (the long-context setting), the planner's 8-layer
Llama-shaped model (planner7m) at the longest sequence this bench runs on CPU. Both models are built in
the same process with the same weights; their timed forward+backward blocks alternate, so a machine that
gets busier or quieter hurts both alike. Time is this process's CPU time (one thread). Reports tokens/s
(median over the blocks) and the ratio tiled / untiled. The tiled MLP runs each tile's MLP forward once
more in backward: under full checkpointing the MLP's forward then runs three times instead of two.

    python bench/tiled_mlp.py [--seq 8192] [--tiles 4] [--reps 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import describe_machine, machine_info, this_command, write_json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--tiles", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch

    from dtlaunch.job.compose import compose
    from dtlaunch.models.registry import model_spec
    from dtlaunch.train.features.tiled_mlp import apply_tiled_mlp
    from dtlaunch.train.parallel.ac import apply_ac
    from dtlaunch.train.parallel.init_weights import materialize_and_init

    torch.set_num_threads(1)
    cfg = compose(
        [
            "model=planner7m",
            f"model.max_seq_len={args.seq}",
            f"training.seq_len={args.seq}",
            "training.activation_checkpointing=full",
        ]
    ).cfg
    plain = model_spec(cfg.model).build(cfg.model, rope_len=args.seq, device="meta")
    materialize_and_init(plain, torch.device("cpu"), 0, init_source=plain)
    tiled = copy.deepcopy(plain)
    apply_tiled_mlp(tiled, args.tiles)
    for m in (plain, tiled):
        apply_ac(m, cfg.training)
    tokens = torch.randint(0, int(cfg.model.vocab_size), (1, args.seq + 1), generator=torch.Generator().manual_seed(0))

    def step(model: torch.nn.Module) -> float:
        start = time.process_time()
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        model.zero_grad(set_to_none=True)
        return args.seq / (time.process_time() - start)

    step(plain), step(tiled)  # warm-up
    rates: dict[str, list[float]] = {"untiled": [], "tiled": []}
    for _ in range(args.reps):
        rates["untiled"].append(step(plain))
        rates["tiled"].append(step(tiled))
    med = {k: statistics.median(v) for k, v in rates.items()}
    ratio = med["tiled"] / med["untiled"]
    print(describe_machine(machine_info()))
    print(
        f"planner7m, {args.seq} tokens, full AC, fp32: untiled {med['untiled']:.0f} tok/s, "
        f"{args.tiles} tiles {med['tiled']:.0f} tok/s, ratio {ratio:.3f}"
    )
    if args.json:
        write_json(
            Path(args.json),
            {"command": this_command(), "tokens_per_s": med, "ratio": ratio, "seq": args.seq, "tiles": args.tiles},
        )


if __name__ == "__main__":
    main()
