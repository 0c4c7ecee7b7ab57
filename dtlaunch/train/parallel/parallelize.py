"""One path from a meta-device model (or pipeline stage) to a parallel, initialised module.

Fixed order, one concern per function: float8 linears (torchao swaps modules first) -> tensor parallel ->
context parallel (swaps the attention kernel for ring attention) -> expert parallel (routed experts only,
dtlaunch.train.parallel.expert_parallel) -> tiled MLP (dtlaunch.train.features.tiled_mlp) -> activation checkpointing -> activation offload (hooks on the
checkpointed blocks, dtlaunch.train.features.offload_activations) -> compile ->
FSDP2 (ZeRO-2/3, HSDP) -> materialise + init -> DDP (ZeRO-0/1). DDP comes after materialising because
it needs real tensors; FSDP2 shards meta parameters, so each rank only ever allocates its shard.

Activation checkpointing ("none", "full", and the "selective" policies): dtlaunch.train.parallel.ac.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtlaunch.config.decisions import Decisions, offload_composes_with_compile
from dtlaunch.config.schema import CpStyle
from dtlaunch.models.dtypes import torch_dtype
from dtlaunch.train.features.tiled_mlp import apply_tiled_mlp
from dtlaunch.train.parallel.ac import apply_ac
from dtlaunch.train.parallel.cpu_offload import buffers_to, init_device, offload_policy
from dtlaunch.train.parallel.float8 import apply_float8
from dtlaunch.train.parallel.frozen_base import convert_frozen_base, frozen_ends
from dtlaunch.train.parallel.head_unit import own_head_unit
from dtlaunch.train.parallel.init_weights import allocate_without_values, materialize_and_init
from dtlaunch.train.parallel.mesh import ExpertMeshes, dp_mesh, expert_meshes, sub_mesh
from dtlaunch.train.parallel.qlora import ddp_skip_nf4

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def parallelize(
    model: nn.Module,
    world_mesh: DeviceMesh,
    cfg: JobConfig,
    dec: Decisions,
    init: bool = True,
    frozen: bool = False,
    weights: Any = None,
) -> nn.Module:
    """Apply the decided layout to `model` (a Llama or a pipeline stage of one) and initialise its weights.

    Returns the module to train: `model` itself (TP/FSDP act in place) or its DDP wrapper. init=False
    allocates the parameters without giving them values (`plan --trace` under fake tensors). frozen=True
    (DPO's reference copy, forward only): no DDP (nothing to reduce) and FSDP reshards after every forward
    (no backward would free the gathered weights). weights: the values to load instead of model.init_from's
    (dtlaunch.train.parallel.init_weights.materialize_and_init).
    """
    device = _device(world_mesh)
    zero = int(cfg.strategy.zero_stage)
    data_mesh = dp_mesh(world_mesh)
    layout, fsdp = dec.layout, dec.fsdp
    if data_mesh is None and fsdp:
        data_mesh = world_mesh["dp_shard"]  # CPU offload on one rank: FSDP over the world's 1-sized dim
    if dec.residual_in_compute_dtype:  # precision.residual_dtype (checked: a registry decoder)
        model.keep_residual_in(torch_dtype(cfg.precision.param_dtype))
    apply_float8(model, cfg.precision, device, fsdp=fsdp)
    tp_mesh = sub_mesh(world_mesh, "tp")
    if tp_mesh is not None:
        from dtlaunch.train.parallel.tensor_parallel import apply_tp

        apply_tp(model, tp_mesh, cfg)
    cp_mesh = sub_mesh(world_mesh, "cp")
    if cp_mesh is not None and cfg.strategy.cp_style == CpStyle.ulysses:
        from dtlaunch.train.parallel.ulysses import apply_ulysses

        apply_ulysses(model, cp_mesh)  # head shards over the whole sequence, of TP's local heads
    elif cp_mesh is not None:
        from dtlaunch.train.parallel.context_parallel import apply_cp

        apply_cp(model, cp_mesh)  # attention over the whole sequence; TP's heads stay local to a CP rank
    experts = expert_meshes(world_mesh, layout.ep)
    if experts is not None:
        from dtlaunch.train.parallel.expert_parallel import apply_ep

        apply_ep(model, experts.ep)
    apply_tiled_mlp(model, dec.mlp_tiles)  # inside each block: checkpointing wraps it too
    apply_ac(model, cfg.training)
    offload = dec.activation_offload
    if offload:
        from dtlaunch.train.features.offload_activations import apply_activation_offload

        apply_activation_offload(model, device)
    if cfg.training.compile:
        apply_compile(
            model,
            inside_checkpoint=offload and offload_composes_with_compile(cfg.training.activation_checkpointing),
            documents=bool(cfg.data.document_mask),
        )
    # LoRA / QLoRA: frozen linears in the compute dtype, QLoRA's block linears NF4; here, on meta, so that
    # FSDP2 shards what is stored.
    convert_frozen_base(model, cfg, shards=data_mesh.size(data_mesh.ndim - 1) if fsdp else 1, fsdp=fsdp)
    if fsdp:
        reshard = zero == 3 or frozen
        apply_fsdp(
            model,
            data_mesh,
            cfg,
            reshard_after_forward=reshard,
            experts=experts,
            dp=layout.dp,
            tp=layout.tp,
            loss_chunks=dec.loss_chunks,
        )
    # FSDP CPU offload: parameters materialised on the host, buffers on the device (parallel.cpu_offload).
    where = init_device(cfg, device)
    if init:
        materialize_and_init(model, where, int(cfg.training.seed), init_source=model, weights=weights)
    else:
        allocate_without_values(model, where)
    if where != device:
        buffers_to(model, device)
    if data_mesh is not None and zero <= 1 and not frozen:
        # DDP x TP is refused by dtlaunch.job.rules.strategy.check_zero before launch.
        return apply_ddp(model, dp_mesh(world_mesh, flatten=True), cfg, device)
    return model


def _device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def apply_compile(model: nn.Module, inside_checkpoint: bool = False, documents: bool = False) -> None:
    """Compile each block in place (`Module.compile` keeps parameter names free of `_orig_mod`).

    inside_checkpoint (activation offload): compile the block each checkpoint wrapper holds, not the
    wrapper, so that the offload hooks on the wrapper and the checkpoint's saving of the block input run
    eagerly outside the compiled graph; the recompute in backward runs the compiled block again.
    documents (data.document_mask): attention runs eagerly between the block's two compiled halves; it
    loops over each batch's document lengths (dtlaunch.models.dense.documents), which compiled would be a
    recompile per batch."""
    backend = compile_backend()
    for block in model.layers.values():
        if documents:
            for mod in block.modules():
                if hasattr(mod, "attention_fn"):
                    mod.attention_fn = torch.compiler.disable(mod.attention_fn)
        (block._checkpoint_wrapped_module if inside_checkpoint else block).compile(backend=backend)


def compile_backend() -> str:
    """Inductor, except under fake tensors (`plan --trace`): Inductor's generated kernels read the inputs'
    raw data pointers, which a fake tensor does not have (its compiled block segfaulted the trace). There the
    blocks compile with Inductor's decompositions and partitioner (what the compiled forward saves for
    backward, what it recomputes) and run as ATen ops, which the fake mode executes on shapes."""
    from torch._guards import active_fake_mode

    return "inductor" if active_fake_mode() is None else "aot_eager_decomp_partition"


def mp_policy(cfg: JobConfig) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(
        param_dtype=torch_dtype(cfg.precision.param_dtype), reduce_dtype=torch_dtype(cfg.precision.reduce_dtype)
    )


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    cfg: JobConfig,
    reshard_after_forward: bool,
    experts: ExpertMeshes | None = None,
    dp: int = 1,
    tp: int = 1,
    loss_chunks: int = 1,
) -> None:
    """FSDP2 per block, then the root (embedding, norm, output). A 2-D mesh gives HSDP. A frozen
    embedding and head (LoRA / QLoRA) are units of their own, resharded after use: the root unit is
    not, so in it they would stay gathered from forward to the end of backward. So is a trained, untied
    head under the chunked loss (dtlaunch.train.parallel.head_unit): its gradient is reduce-scattered
    right after the loss's backward instead of at the root's post-backward.

    Under expert parallel each block's routed experts are their own FSDP unit on the expert-FSDP mesh
    (the shard ranks that hold the same experts), before the block takes the rest over `mesh`."""
    from torch.distributed.fsdp import fully_shard

    policy = mp_policy(cfg)
    offload = offload_policy(cfg, _device(mesh))  # strategy.cpu_offload: dtlaunch.train.parallel.cpu_offload
    for block in model.layers.values():
        if experts is not None:
            shard_experts(block, experts, policy, reshard_after_forward, dp)
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward, **offload)
    for end in frozen_ends(model, head=False) + own_head_unit(model, cfg, tp, loss_chunks):
        fully_shard(end, mesh=mesh, mp_policy=policy, reshard_after_forward=True, **offload)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward, **offload)


def shard_experts(block: nn.Module, meshes: ExpertMeshes, policy: Any, reshard_after_forward: bool, dp: int) -> None:
    """FSDP2 over the routed experts of `block`; their gradients divided by all `dp` data-parallel ranks.

    FSDP averages over its own mesh, the ranks holding the same experts; but each expert's gradient
    already sums the tokens of all EP peers (the all-to-all brought them), so the mean over the global
    batch divides by the whole data-parallel degree."""
    from torch.distributed.fsdp import fully_shard

    from dtlaunch.train.parallel.expert_parallel import routed_expert_modules

    for experts in routed_expert_modules(block):
        fully_shard(experts, mesh=meshes.fsdp, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        experts.set_gradient_divide_factor(float(dp))
        shard_group = meshes.fsdp.size(meshes.fsdp.ndim - 1)
        if meshes.fsdp.device_type == "cpu" and shard_group > 1:
            # A divide factor other than the group size is a pre-multiplied sum, which gloo lacks: sum,
            # then divide. (Not on a 1-rank shard group: torch then divides its local copy already.)
            experts.set_force_sum_reduction_for_comms(True)


def apply_ddp(model: nn.Module, mesh: DeviceMesh, cfg: JobConfig, device: torch.device) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    ddp_skip_nf4(model)  # QLoRA's frozen NF4 weights: neither broadcast nor bucketed
    # No buffer broadcast before every forward (DDP's default): the model's buffers (RoPE tables) are
    # computed identically on every rank and never change, and the broadcast costs a collective per step.
    ddp = DistributedDataParallel(model, process_group=mesh.get_group(), device_ids=ids, **no_buffer_sync())
    reduce = cfg.precision.reduce_dtype
    if reduce != "fp32":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = default_hooks.bf16_compress_hook if reduce == "bf16" else default_hooks.fp16_compress_hook
        ddp.register_comm_hook(mesh.get_group(), hook)
    return ddp


def no_buffer_sync() -> dict:
    """DDP's keyword for "no buffer broadcast before each forward": torch 2.13 renamed it."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def uses_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def compute_context(model_parts: Iterable[nn.Module], cfg: JobConfig, device: torch.device) -> Any:
    """Low-precision compute where FSDP's MixedPrecisionPolicy does not already cast (DDP, single
    process): autocast keeps fp32 master weights and casts matmul inputs."""
    dtype = torch_dtype(cfg.precision.param_dtype)
    if dtype == torch.float32 or all(uses_fsdp(m) for m in model_parts):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)
