"""The frozen base of a LoRA / QLoRA run, converted on the meta device before FSDP2 and materialisation.

Full training keeps fp32 master weights because the optimizer updates them; a frozen weight is never
updated, and every matmul reads it in the compute dtype (FSDP2's MixedPrecisionPolicy casts it, or
autocast does). So the frozen linears (the blocks' and the output head) are stored in
precision.param_dtype: the same numbers reach every matmul, at half the bytes (Llama-3.1-8B's base: 16 GB
instead of 32 GB). Under QLoRA the blocks' linears become NF4 instead (dtlaunch.train.parallel.qlora). Norm gains
and the embedding stay fp32: the embedding's output is the residual stream, which autocast keeps in fp32.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from dtlaunch.train.parallel.qlora import DTYPES, quantize_base


def convert_frozen_base(model: nn.Module, cfg: Any, shards: int) -> None:
    """peft.method=lora/qlora: frozen linear weights (and biases) to the compute dtype, then (qlora) the
    block linears to NF4. `shards`: the FSDP shard count (1 without FSDP). Nothing under peft=none."""
    if str(cfg.peft.method) == "none":
        return
    dtype = DTYPES[str(cfg.precision.param_dtype)]
    # A head tied to the embedding is the embedding's parameter: it stays as it is (and stays tied).
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    for mod in model.modules():
        if not isinstance(mod, nn.Linear):
            continue
        for name in ("weight", "bias"):
            p = getattr(mod, name, None)
            if isinstance(p, nn.Parameter) and not p.requires_grad and p.dtype != dtype and counts[id(p)] == 1:
                setattr(mod, name, nn.Parameter(p.detach().to(dtype), requires_grad=False))
    quantize_base(model, cfg, shards)
