"""What one Llama block saves for backward, eager vs torch.compile, against the planner's per-token model.

Runs a block of a built-in model on CPU (fp32 or bf16, micro-batch 2 x 128 tokens), forward + backward
twice (the second call is measured, after compilation), and sums the unique storages that autograd's
saved-tensor hooks see, minus parameters and the RoPE tables (bytes per token). Eager selective AC keeps
its saved values inside checkpoint's own storage, out of the hooks' sight, so AC rows are compiled only;
eager AC is measured by the planner-accuracy runs instead. Compared with
dtlaunch.models.dense.activations.block_bytes(..., compiled=True): the calibration of the compile model.

    python bench/compile_saved.py [--models small,tiny] [--dtypes fp32,bf16]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from types import SimpleNamespace

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import markdown_table

B, S = 2, 128
MODES = {  # name -> (training section for dtlaunch.train.parallel.ac.apply_ac, planner kind)
    "none": ("none", "op", 0.0),
    "selective (op)": ("selective", "op", 0.0),
    "full": ("full", "op", 0.0),
}


def saved_bytes_per_token(model: torch.nn.Module, mode: tuple, compiled: bool, dtype: torch.dtype, dim: int) -> float:
    from dtlaunch.train.parallel.ac import apply_ac

    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleDict({"0": copy.deepcopy(model.layers["0"])})
    ac, policy, budget = mode
    apply_ac(
        holder,
        SimpleNamespace(activation_checkpointing=ac, ac_policy=policy, ac_every_n_layers=1, ac_memory_budget=budget),
    )
    block = holder.layers["0"]
    if compiled:
        block.compile()
    x = torch.randn(B, S, dim, dtype=dtype, requires_grad=True)
    cos, sin = model.rope_cos[:S].to(dtype), model.rope_sin[:S].to(dtype)
    skip = {p.untyped_storage().data_ptr() for p in block.parameters()}
    skip |= {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    for _ in range(2):
        seen.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = block(x, cos, sin)
        y.sum().backward()
    return sum(seen.values()) / (B * S)


def main(argv: list[str] | None = None) -> None:
    from dtlaunch.job.compose import compose
    from dtlaunch.models.dense import activations as act
    from dtlaunch.models.dense.model import build_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="small,tiny")
    ap.add_argument("--dtypes", default="fp32,bf16")
    args = ap.parse_args(argv)
    rows = []
    for name in args.models.split(","):
        cfg = compose([f"model={name}"]).cfg
        d = act.BlockDims.of(cfg.model)
        for dt in args.dtypes.split(","):
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dt]
            e = act.DTYPE_BYTES[dt]
            torch.manual_seed(0)
            model = build_model(cfg.model, rope_len=S, device="cpu").to(dtype)
            for label, mode in MODES.items():
                for compiled in (False, True) if mode[0] == "none" else (True,):
                    measured = saved_bytes_per_token(model, mode, compiled, dtype, int(cfg.model.dim))
                    planned = act.block_bytes(d, e, mode[0], compiled=compiled)
                    err = (planned - measured) / measured * 100
                    rows.append(
                        [
                            name,
                            dt,
                            label,
                            "compile" if compiled else "eager",
                            f"{measured:,.0f}",
                            f"{planned:,.0f}",
                            f"{err:+.1f} %",
                        ]
                    )
                    print(" | ".join(rows[-1]), flush=True)
    print(markdown_table(["model", "dtype", "AC", "mode", "measured B/token", "planned B/token", "error"], rows))


if __name__ == "__main__":
    main()
