"""What the memory-light RMSNorm (dtlaunch.models.dense.norm) saves and costs, against the plain-op norm,
in one run.

One process, one thread, the planner's 8-layer Llama-shaped model (planner7m), no activation checkpointing
so every norm's saved tensors are alive at once. Two copies with the same weights: dtlaunch's norm, and the
same model whose norms run the plain ops autograd differentiates (Meta's and Hugging Face's formula). Their
timed forward+backward passes alternate, so a busier or quieter machine hurts both alike. Reports the
bytes per token autograd keeps for backward (unique storages seen by saved-tensor hooks, parameters
excluded), tokens/s (median of this process's CPU time) and both ratios, and checks the gradients are
bit-identical.

    python bench/rms_norm.py [--seq 4096] [--dtype bf16] [--reps 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import types
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import describe_machine, machine_info, this_command, write_json


def plain_forward(self, x):  # the plain-op norm, as autograd would differentiate it
    xf = x.float()
    y = (xf * (xf.pow(2).mean(-1, keepdim=True) + self.eps).rsqrt()).type_as(x) * self.weight
    return y if self.out_dtype is None else y.to(self.out_dtype)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch

    from dtlaunch.job.compose import compose
    from dtlaunch.models.dense.norm import RMSNorm
    from dtlaunch.models.registry import model_spec
    from dtlaunch.train.parallel.init_weights import materialize_and_init

    torch.set_num_threads(1)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cfg = compose(["model=planner7m", f"model.max_seq_len={args.seq}", f"training.seq_len={args.seq}"]).cfg
    light = model_spec(cfg.model).build(cfg.model, rope_len=args.seq, device="meta")
    materialize_and_init(light, torch.device("cpu"), 0, init_source=light)
    light = light.to(dtype)
    plain = copy.deepcopy(light)
    for mod in plain.modules():
        if isinstance(mod, RMSNorm):
            mod.forward = types.MethodType(plain_forward, mod)
    tokens = torch.randint(0, int(cfg.model.vocab_size), (1, args.seq + 1), generator=torch.Generator().manual_seed(0))
    params = {p.untyped_storage().data_ptr() for m in (light, plain) for p in m.parameters()}
    params |= {b.untyped_storage().data_ptr() for m in (light, plain) for b in m.buffers()}

    def saved_per_token(model: torch.nn.Module) -> float:
        seen: dict[int, int] = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                seen[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            hidden = model.forward(tokens[:, :-1])
        hidden.float().sum().backward()
        model.zero_grad(set_to_none=True)
        return sum(seen.values()) / args.seq

    def step(model: torch.nn.Module) -> float:
        start = time.process_time()
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        return args.seq / (time.process_time() - start)

    step(light), step(plain)  # warm-up; leaves each model's gradients of the same batch
    same = all(torch.equal(a.grad, b.grad) for a, b in zip(light.parameters(), plain.parameters(), strict=True))
    light.zero_grad(set_to_none=True), plain.zero_grad(set_to_none=True)
    saved = {"plain": saved_per_token(plain), "light": saved_per_token(light)}
    rates: dict[str, list[float]] = {"plain": [], "light": []}
    for _ in range(args.reps):
        for name, model in (("plain", plain), ("light", light)):
            rates[name].append(step(model))
            model.zero_grad(set_to_none=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(describe_machine(machine_info()))
    print(
        f"planner7m, {args.seq} tokens, no AC, {args.dtype}: saved for backward {saved['plain']:,.0f} -> "
        f"{saved['light']:,.0f} B/token (ratio {saved['light'] / saved['plain']:.3f}); "
        f"plain {med['plain']:.0f} tok/s, light {med['light']:.0f} tok/s (ratio {med['light'] / med['plain']:.3f}); "
        f"gradients bit-identical: {same}"
    )
    if args.json:
        write_json(
            Path(args.json),
            {
                "command": this_command(),
                "machine": machine_info(),
                "seq": args.seq,
                "dtype": args.dtype,
                "saved_bytes_per_token": saved,
                "tokens_per_s": med,
                "throughput_ratio": med["light"] / med["plain"],
                "gradients_bit_identical": same,
            },
        )


if __name__ == "__main__":
    main()
