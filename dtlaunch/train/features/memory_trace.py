"""The planner's traced second opinion (`dtlaunch plan --trace`, dtlaunch.plan.trace): the worker's real
build path in ONE process, tracked per memory category.

Rank `rank` of the full world is emulated with the "fake" process-group backend (collectives move no
data but allocate what a real rank allocates), on real CPU tensors when the run is small enough, else
under FakeTensorMode (shapes and dtypes, no storage). The build is the worker's own runtime object
(dtlaunch.train.runtime.build_runtime: the model on meta, `parallelize` (TP -> AC -> FSDP/DDP) or the
pipeline stage split, the optimizer, the schedules; weights allocated without values under fake tensors);
then `steps` runs of the worker's own `train_step` (dtlaunch.train.step) on random tokens (under context
parallel, this rank's chunks of each sequence and their positions, as the loader cuts them), without its
host-side read of the gradient norm (a fake tensor has no value) and without fp16 loss scaling (its
overflow check reads the host too; its state is a few scalars). The first step runs untracked (it creates the optimizer state); of each step's accumulation micro-steps
only the first and the last run (`traced_micro_steps`). On real tensors torch's MemTracker gives the
peak and the bytes per category (parameters, gradients, optimizer state, activations, temporaries);
on fake tensors the runtime's StorageCounter gives the peak (torch's trackers mis-size fake DTensor
shards; see `_trace`). Measured at real sizes against the analytic plan: tests/unit/test_plan_trace.py.

Pipeline parallel (1F1B, GPipe; one stage per rank, no TP): torch's schedules cannot run on a fake
group (their shape inference receives sizes from real peers), so the trace replays the schedule's
order of forwards and backwards on this rank's stage module itself: received activations and
gradients are random tensors of the right shape and dtype, the last stage computes the runtime's
loss. What the stage holds (parameters, optimizer state, activations of the micro-batches in flight,
gradients as they accumulate) comes from running its real code; the order comes from the schedule's
definition (the same order torch's Schedule1F1B / ScheduleGPipe run).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel
from torch.testing._internal.distributed.fake_pg import FakeStore

from dtlaunch.config.decisions import Decisions, fused_optimizer
from dtlaunch.config.layout import Layout
from dtlaunch.config.schema import ObjectiveName
from dtlaunch.models.dtypes import torch_dtype
from dtlaunch.models.registry import model_spec
from dtlaunch.train.batch import MicroBatch, RolloutRows
from dtlaunch.train.features.peft import apply_peft
from dtlaunch.train.loss import cross_entropy
from dtlaunch.train.observe.memtrack import StorageCounter, state_tensors
from dtlaunch.train.optim import build_optimizer
from dtlaunch.train.parallel.mesh import build_mesh, cp_rank_size, expert_meshes
from dtlaunch.train.parallel.parallelize import compute_context, parallelize
from dtlaunch.train.parallel.pipeline import build_stage_modules, set_fsdp_sync
from dtlaunch.train.parallel.process_group import DistEnv
from dtlaunch.train.runtime import build_runtime
from dtlaunch.train.step import clip_grad_norm, train_step

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def trace_rank(cfg: JobConfig, layout: Layout, rank: int, steps: int, fake: bool) -> dict:
    """Rank `rank` of the job's world in this process, on a fake process group: {"peak_bytes",
    "categories" (bytes at the peak), "rank", "stage", "tensors": "real"|"fake"}."""

    if int(cfg.strategy.zero_stage) <= 1 and layout.dp > 1 and fake:
        # DDP's C++ reducer allocates its buckets outside the dispatcher: fake tensors break it.
        fake = False
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world)
    mesh = build_mesh(layout, "cpu")  # outside FakeTensorMode: the mesh holds real rank tensors
    expert_meshes(mesh, layout.ep)  # so do the expert views of it, built once per mesh and cached
    mode: Any = contextlib.nullcontext()
    if fake:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with mode, _real_meshes(fake):
            torch.manual_seed(int(cfg.training.seed))
            return {**_trace(cfg, layout, mesh, rank, steps), "tensors": "fake" if fake else "real"}
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _real_meshes(fake: bool) -> Any:
    """Device meshes hold real rank tensors (their coordinates come from `nonzero`, which fake tensors
    cannot answer): FSDP x TP builds a combined mesh while sharding, so build every mesh outside the
    fake mode."""
    if not fake:
        yield
        return

    real = DeviceMesh.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            real(self, *args, **kwargs)

    DeviceMesh.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh.__init__ = real  # type: ignore[method-assign]


def _trace(cfg: JobConfig, layout: Layout, mesh: Any, rank: int, steps: int) -> dict:
    if layout.pp > 1:
        return _trace_pipeline(cfg, layout, mesh, rank, steps)

    device = torch.device("cpu")
    env = DistEnv(rank=rank, world=layout.world, local_rank=rank, restart=0, device=device, backend="fake")
    # The worker's runtime; under fake tensors the weights are allocated without values (a seeded init
    # would build full-size real tensors), and the optimizer uses the kernels of the traced hardware.
    rt = build_runtime(
        cfg, env, layout, mesh, init=active_fake_mode() is None, fused=fused_optimizer(cfg.hardware), loss_scaler=False
    )
    parts, optimizers = rt.model_parts, rt.optimizers
    for part in parts:
        _local_ddp_hook(part)
    batches = RandomBatches(cfg, rt.decisions.rows_per_sample, *cp_rank_size(rt.mesh))
    # The first step runs untracked. It creates the optimizer state (later steps hold the same state, so
    # their peak is the run's), and it fills DTensor's sharding-propagation cache: on a cache miss that
    # propagation runs ops on full, unsharded shapes under the active fake mode, which the tracker would
    # count as allocations (measured: 13x the real optimizer state on the first step of an 8B trace).
    _one_step(rt, batches, None, warmup=True)
    fake_mode = active_fake_mode()
    if fake_mode is not None:
        # Fake tensors: the peak from StorageCounter (the runtime's own measure), without categories.
        # torch's trackers mis-size fake FSDP x TP shards: they follow FSDP's storage resizes with global
        # sizes (measured: a phantom full vocab x dim fp32 "Temp" on a 64-rank trace, +76 %).
        # DPO's and KTO's frozen reference copy is held all along too, as the worker's own tracker counts it
        # (torch's tracker, below, follows it by itself).
        held = [*parts, *(rt.reference.modules if rt.reference is not None else [])]
        peak = _counted_peak(lambda: _one_step(rt, batches, None), held, optimizers, steps)
        return {"peak_bytes": peak, "categories": {}, "rank": rank, "stage": 0}
    # Real tensors: torch's tracker, which also splits the peak into categories (its peak equals
    # StorageCounter's on real tensors: tests/unit/test_memtrack.py).
    tracker = _tracker(parts, optimizers)
    _restart_after_reference(rt, tracker)
    peak, snap = 0, {}
    for _ in range(_tracked_steps(steps)):
        with tracker:
            _one_step(rt, batches, tracker)
        cur = tracker.get_tracker_snapshot("peak")
        total = int(sum(d.get("Total", 0) for d in cur.values()))
        if total >= peak:
            peak, snap = total, cur
        tracker.reset_mod_stats()
    return {"peak_bytes": peak, "categories": _categories(snap), "rank": rank, "stage": 0}


def _one_f1b_order(n_mb: int, pp: int, stage: int) -> list[tuple[str, int]]:
    """Schedule1F1B on one stage: min(pp - stage, n_mb) forwards, then backward/forward pairs, then the
    remaining backwards."""
    warm = min(pp - stage, n_mb)
    order = [("F", i) for i in range(warm)]
    f = warm
    for b in range(n_mb):
        order.append(("B", b))
        if f < n_mb:
            order.append(("F", f))
            f += 1
    return order


PP_ORDERS = {
    "1f1b": _one_f1b_order,
    "gpipe": lambda n_mb, pp, stage: [("F", i) for i in range(n_mb)] + [("B", i) for i in range(n_mb)],
}


def _trace_pipeline(cfg: JobConfig, layout: Layout, mesh: Any, rank: int, steps: int) -> dict:
    """Rank `rank`'s pipeline stage, its micro-batches in the schedule's order (see the module doc)."""

    device = torch.device("cpu")
    stage = rank // (layout.world // layout.pp)  # pp is the outermost mesh dimension
    # Split the meta model outside the fake mode: deep-copying meta parameters under it leaves weak
    # references on them that the later materialisation (to_empty) refuses.
    with unset_fake_temporarily():
        model = model_spec(cfg.model).build(cfg.model, rope_len=int(cfg.training.seq_len), device="meta")
        apply_peft(model, cfg)  # as build_model_parts does
        (idx, part), *_ = build_stage_modules(model, cfg, layout, stage)
    dec = Decisions.of(cfg, layout)
    part = parallelize(part, mesh, cfg, dec, init=active_fake_mode() is None)
    opt = build_optimizer(part, cfg, device, fused=fused_optimizer(cfg.hardware))
    t, m = cfg.training, cfg.model
    n_mb, accum = dec.pp_microbatches, dec.grad_accum
    mb = int(t.micro_batch) // n_mb
    first, last = idx == 0, idx == layout.pp - 1
    fsdp = isinstance(part, FSDPModule)
    # Between stages flows the residual stream: in the compute dtype under FSDP's mixed precision,
    # fp32 otherwise (autocast's matmul outputs are added to an fp32 residual).
    hidden_dtype = torch_dtype(cfg.precision.param_dtype if fsdp else "fp32")
    # Under sequence parallel the last block's output, what the next stage receives, is this TP rank's
    # shard of the sequence (torch's PipelineStage infers (B, S/tp, D)); the stage's first block takes
    # it as that shard. A full-length tensor there would be read as one tp-th of a tp-times-longer
    # sequence (the RoPE tables then fail to broadcast).
    hidden_seq = int(t.seq_len) // (layout.tp if layout.tp > 1 and cfg.strategy.sequence_parallel else 1)
    order = PP_ORDERS[cfg.strategy.pp_schedule](n_mb, layout.pp, stage)
    scale = 1.0 / (n_mb * accum)
    reshard = bool(cfg.strategy.pp_reshard_grads)

    def one_step(warmup: bool = False) -> None:

        for _ in traced_micro_steps(accum, warmup):
            held: dict[int, tuple[Any, ...]] = {}
            for kind, i in order:
                last_bwd = kind == "B" and i == n_mb - 1
                if fsdp:  # what the pipeline stage (dtlaunch.train.parallel.pipeline) does around each backward
                    set_fsdp_sync(part, last_bwd or reshard)
                if kind == "F":
                    if first:
                        x = torch.randint(0, int(m.vocab_size), (mb, int(t.seq_len)))
                    else:  # the activation received from the previous stage
                        x = torch.randn(mb, hidden_seq, int(m.dim), dtype=hidden_dtype, requires_grad=True)
                    with compute_context([part], cfg, device):
                        out = part(x)
                    # The stage keeps its output (on the last stage the logits) referenced until that
                    # micro-batch's backward (torch's PipelineStage.fwd_cache), not only the loss.
                    held[i] = (x, out)
                    if last:
                        y = torch.randint(0, int(m.vocab_size), (mb, int(t.seq_len)))
                        held[i] = (x, cross_entropy(out, y) * scale, out)
                else:
                    x, out, *_ = held.pop(i)
                    if last:
                        out.backward()
                    else:  # the gradient received from the next stage
                        out.backward(torch.randn_like(out))
                    del x, out, _
        clip_grad_norm([list(part.parameters())], float(t.grad_clip), mesh["pp"])
        opt.step()
        opt.zero_grad(set_to_none=True)

    one_step(warmup=True)  # untracked: see _trace
    # MemTracker attributes memory per module and refuses a module's second forward before its
    # backward, which a pipeline does by design: count storages instead (no categories).
    peak = _counted_peak(one_step, [part], [opt], steps)
    return {"peak_bytes": peak, "categories": {}, "rank": rank, "stage": stage}


def _tracked_steps(steps: int) -> int:
    """Of `steps` optimizer steps, the first is the untracked warm-up; at least one is tracked."""
    return max(1, steps - 1)


def _counted_peak(one_step: Any, parts: list, optimizers: list, steps: int) -> int:
    """The peak StorageCounter (the runtime's CPU measure) sees over the tracked steps (all but the
    untracked warm-up), with what exists between steps counted first."""

    counter = StorageCounter(fake_mode=active_fake_mode())
    for _ in range(_tracked_steps(steps)):
        counter.add_existing(state_tensors(parts, optimizers))
        with counter:
            one_step()
    return counter.peak


def _categories(snap: dict) -> dict[str, int]:
    cats: dict[str, int] = {}
    for dev_snap in snap.values():
        for k, v in dev_snap.items():
            if k != "Total":
                name = str(getattr(k, "value", k))
                cats[name] = cats.get(name, 0) + int(v)
    return cats


def _restart_after_reference(rt: Any, tracker: Any) -> None:
    """DPO with LoRA's adapters-off reference runs the policy's modules twice per micro-step, which torch's
    tracker refuses ("multiple iterative calls"): its per-module statistics restart after the reference
    forward (a no-grad forward whose memory is freed before the policy's)."""
    from dtlaunch.train.objectives.reference import AdaptersOff

    if not isinstance(rt.reference, AdaptersOff):
        return
    reference = rt.reference

    def then_restart(*args: Any) -> Any:
        out = reference(*args)
        tracker.reset_mod_stats()
        return out

    rt.reference = then_restart


def _tracker(parts: list, optimizers: list) -> Any:
    """FSDPMemTracker for one FSDP module (it follows FSDP2's storage resizes); MemTracker otherwise."""

    if len(parts) == 1 and isinstance(parts[0], FSDPModule) and len(optimizers) == 1:
        return _FSDPMemTracker(parts[0], optimizers[0])
    tracker = _MemTracker()
    tracker.track_external(*parts, *optimizers)
    return tracker


class _NoHook:
    def remove(self) -> None:
        pass


class _SkipFrozen:
    """torch's trackers register a gradient hook on every parameter of each module they enter, which a
    frozen parameter (LoRA's base, DPO's reference copy) refuses ("cannot register a hook on a tensor
    that doesn't require gradient"). A frozen parameter never has a gradient to count: it is marked as
    hooked already, with a hook that removes nothing, and is still counted as a parameter."""

    _param_to_grad_hook_handles: Any

    def _track_module_params_and_buffers(self, module: torch.nn.Module, install_grad_hooks: bool = True) -> Any:
        for p in module.parameters():
            if not p.requires_grad and self._param_to_grad_hook_handles.get(p) is None:
                self._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
        return super()._track_module_params_and_buffers(module, install_grad_hooks)  # type: ignore[misc]


class _MemTracker(_SkipFrozen, MemTracker):
    pass


class _FSDPMemTracker(_SkipFrozen, FSDPMemTracker):
    pass


def _local_ddp_hook(part: Any) -> None:
    """A fake group's all-reduce returns no future value, which DDP's reducer rejects: hand the bucket
    back as its own result (the default hook reduces in place, so memory is the same)."""

    if not isinstance(part, DistributedDataParallel) or part._comm_hooks:
        return

    def hook(state, bucket):  # noqa: ANN001, ANN202 (DDP checks the annotations: leave them off)
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    part.register_comm_hook(None, hook)


def traced_micro_steps(accum: int, warmup: bool = False) -> list[int]:
    """Which of a step's `accum` micro-steps the trace runs. The first has no gradients yet; every later
    one holds the same gradients (FSDP: the sharded ones, reduce-scattered each micro-step; DDP: the
    full local ones) and runs the same ops, the last adding the gradient sync. So the first and the
    last bound every micro-step's peak, and a 16-way accumulation costs 2 micro-steps, not 16. The
    untracked warm-up needs only the last: it must leave gradients for the optimizer to create its state."""
    if warmup or accum == 1:
        return [accum - 1]
    return [0, accum - 1]


class RandomBatches:
    """Random token micro-batches of the configured shape: what the trace feeds `train_step`."""

    def __init__(self, cfg: JobConfig, rows_per_sample: int, cp_rank: int = 0, cp: int = 1) -> None:
        t = cfg.training
        # Preference objectives: a sample is a pair, two rows (and precomputed reference log-probs).
        rows = int(t.micro_batch) * rows_per_sample
        # Context parallel: this rank's load-balanced chunks of every sequence and their true positions, as
        # the worker's loader hands them (dtlaunch.train.data; context_parallel.local_positions).
        self.shape = (rows, int(t.seq_len) // cp + 1)
        self.model_args: dict = {}
        if cp > 1:
            c = int(t.seq_len) // (2 * cp)
            head, tail = cp_rank * c, (2 * cp - 1 - cp_rank) * c
            self.model_args["positions"] = torch.cat((torch.arange(head, head + c), torch.arange(tail, tail + c)))
        self.vocab = int(cfg.model.vocab_size)
        self.ref_logps = torch.zeros(rows)
        self.labels: Optional[torch.Tensor] = None
        self.rollout: Optional[RolloutRows] = None
        if cfg.objective.name == ObjectiveName.kto:  # half desirable (both of KTO's loss terms run)
            self.labels = torch.arange(int(t.micro_batch)) % 2 == 0
        if cfg.objective.name == ObjectiveName.grpo:
            # The training phase of objective=grpo: rows as a rollout hands them (the rollout itself, its
            # generation and no-grad passes, is analytic only: dtlaunch.plan.generation).
            ref = torch.zeros(rows, int(t.seq_len)) if float(cfg.objective.beta) > 0 else None
            self.rollout = RolloutRows(adv=torch.ones(rows), step_tokens=torch.tensor(1.0), ref=ref)

    def next_batch(self) -> MicroBatch:
        tokens = torch.randint(0, self.vocab, self.shape)
        return MicroBatch(
            tokens[:, :-1],
            tokens[:, 1:],
            model_args=self.model_args,
            ref_logps=self.ref_logps,
            labels=self.labels,
            rollout=self.rollout,
        )


def _one_step(rt: Any, batches: RandomBatches, tracker: Optional[Any], warmup: bool = False) -> None:
    """The worker's train_step for the micro-steps of `traced_micro_steps`, with no host reads; torch's
    tracker restarts its per-module statistics before each micro-step after the first."""

    def before_micro(n: int) -> None:
        if n and tracker is not None:
            tracker.reset_mod_stats()

    micro = traced_micro_steps(rt.accum, warmup)
    train_step(rt, batches, 0, micro_steps=micro, host_reads=False, before_micro=before_micro)
