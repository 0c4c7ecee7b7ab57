"""The loss cost of a bf16 residual stream (precision.residual_dtype=bf16) against autocast's fp32 one.

One process, bf16 autocast over fp32 master weights (the DDP / one-GPU path), the `small` model (6 blocks,
dim 256), trained twice from the same initial weights on the same batches: once with the residual
stream in fp32 (precision.residual_dtype=auto, the default) and once in bf16
(Decoder.keep_residual_in, what precision.residual_dtype=bf16 sets). The data is a fixed random Markov
chain over the vocabulary (each token has a few likely successors), so the loss falls well below
log(vocab) and the two curves can be compared where the model learns. Prints the mean training loss of
the last 50 steps of each run, their difference and ratio, and the largest per-step difference.

    python bench/residual_dtype.py [--steps 300] [--seq 128] [--batch 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import describe_machine, machine_info, this_command, write_json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch

    from dtlaunch.job.compose import compose
    from dtlaunch.models.registry import model_spec
    from dtlaunch.train.parallel.init_weights import materialize_and_init

    torch.set_num_threads(1)
    cfg = compose(["model=small", f"training.seq_len={args.seq}"]).cfg
    vocab = int(cfg.model.vocab_size)
    g = torch.Generator().manual_seed(0)
    # Each token's successors: 4 likely ones (random weights), the rest of the vocabulary rarely.
    logits = torch.full((vocab, vocab), -6.0)
    likely = torch.randint(0, vocab, (vocab, 4), generator=g)
    logits.scatter_(1, likely, torch.randn(vocab, 4, generator=g) + 2.0)
    probs = logits.softmax(-1)

    def batch(step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1000 + step)
        out = torch.empty(args.batch, args.seq + 1, dtype=torch.long)
        out[:, 0] = torch.randint(0, vocab, (args.batch,), generator=gen)
        for i in range(args.seq):
            out[:, i + 1] = torch.multinomial(probs[out[:, i]], 1, generator=gen).squeeze(1)
        return out

    batches = [batch(s) for s in range(args.steps)]
    base = model_spec(cfg.model).build(cfg.model, rope_len=args.seq, device="meta")
    materialize_and_init(base, torch.device("cpu"), 0, init_source=base)

    def train(residual_bf16: bool) -> list[float]:
        model = copy.deepcopy(base)
        if residual_bf16:
            model.keep_residual_in(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        losses = []
        for tokens in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(out.float().flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses

    fp32, bf16 = train(False), train(True)
    tail = min(50, args.steps)
    last = {"fp32": statistics.mean(fp32[-tail:]), "bf16": statistics.mean(bf16[-tail:])}
    diff = last["bf16"] - last["fp32"]
    worst = max(abs(a - b) for a, b in zip(fp32, bf16, strict=True))
    print(describe_machine(machine_info()))
    print(
        f"small, bf16 autocast, {args.steps} steps of {args.batch} x {args.seq} tokens (first loss {fp32[0]:.4f}): "
        f"mean loss of the last {tail} steps fp32 residual {last['fp32']:.4f}, bf16 residual {last['bf16']:.4f}, "
        f"difference {diff:+.4f} ({diff / last['fp32']:+.2%}), ratio {last['bf16'] / last['fp32']:.4f}; "
        f"largest per-step difference {worst:.4f}"
    )
    if args.json:
        write_json(
            Path(args.json),
            {"command": this_command(), "fp32": fp32, "bf16": bf16, "last": last, "difference": diff, "worst": worst},
        )


if __name__ == "__main__":
    main()
