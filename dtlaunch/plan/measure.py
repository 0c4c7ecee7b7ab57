"""Single-process measured peak for calibrating the planner (imports torch; tests and bench only).

Rank 0 of a world of N is emulated with the "fake" process-group backend on REAL CPU tensors:
collectives move no data but allocate exactly what a real rank allocates, so the tracked peak is
that of rank 0 of an N-rank run (values are meaningless, memory is not). Covers DDP, FSDP2
(ZeRO-2/3, bf16 mixed precision) and activation checkpointing; TP and PP need the runtime's own
parallelize/pipeline code and are measured by real multi-process runs instead.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dtlaunch.models.llama import build_model
from dtlaunch.train.memtrack import PeakTracker

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def sac_policy() -> Any:
    """Selective AC as the planner assumes it: keep matmul and SDPA outputs, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    save = {
        torch.ops.aten.mm.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
    }

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        return CheckpointPolicy.MUST_SAVE if func in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def apply_ac(model: torch.nn.Module, mode: str) -> None:
    if mode == "none":
        return
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    for name, block in list(model.layers.items()):
        if mode == "full":
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(
                block, preserve_rng_state=False, context_fn=partial(create_selective_checkpoint_contexts, sac_policy())
            )
        model.layers[name] = wrapped


def measure_peak(cfg: Any, world: int, steps: int = 3, accum: int = 1) -> int:
    """Peak tracked bytes on rank 0 for `cfg` (model/precision/strategy.zero_stage/training) at
    data-parallel world size `world` (dp_shard = world for ZeRO-2/3; world > 1 wraps DDP otherwise)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if int(cfg.strategy.zero_stage) >= 2:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    else:
        # DDP's communication hooks need real results; a DDP rank's memory does not depend on the
        # world size (full replicas + buckets), so a real 1-rank gloo group stands in for rank 0.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return _measure(cfg, world, steps, accum)
    finally:
        dist.destroy_process_group()


def _measure(cfg: Any, world: int, steps: int, accum: int) -> int:
    t, p = cfg.training, cfg.precision
    zero = int(cfg.strategy.zero_stage)
    model = build_model(cfg.model, rope_len=t.seq_len)
    apply_ac(model, t.activation_checkpointing)
    compute = DTYPES[p.param_dtype]
    autocast = False
    if zero >= 2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (world,))
        mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=DTYPES[p.reduce_dtype])
        for block in model.layers.values():
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=zero == 3)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=zero == 3)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for prm in model.parameters():
            prm.normal_(0, 0.02)
        model.rope_cos.copy_(torch.ones_like(model.rope_cos))
        model.rope_sin.copy_(torch.zeros_like(model.rope_sin))
    train_model: torch.nn.Module = model
    if zero < 2:
        autocast = compute != torch.float32
        if world > 1:
            from torch.nn.parallel import DistributedDataParallel

            train_model = DistributedDataParallel(model, gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    tracker = PeakTracker([model], [opt], enabled=True, track_steps=steps)
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        with tracker.step(step):
            for _ in range(accum):
                tokens = torch.randint(0, cfg.model.vocab_size, (t.micro_batch, t.seq_len + 1), generator=g)
                with torch.autocast("cpu", dtype=compute, enabled=autocast):
                    logits = train_model(tokens[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
                del logits
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return tracker.peak_bytes()
