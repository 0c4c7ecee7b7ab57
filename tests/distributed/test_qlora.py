"""QLoRA (LoRA on an NF4 base, torchao) under DDP and FSDP2 against one process, and against LoRA.

Two gloo processes forked from pytest build the runtime object (build_runtime: LoRA adapters, NF4 base
quantised on meta, FSDP2 / DDP, init) and train the same seeded batches as one process with the same
conversions and no mesh. Every layout quantises the whole weight once (the shards are its rows), so the
layouts' losses agree with one process up to the order of sums. FSDP2's all-gathers of the blocks are
recorded: they carry uint8 buffers exactly as large as the ranks' NF4 codes and scales plus the adapters
and norms in bf16, never a bf16 copy of the base.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchao")

from forked_training import SeededBatches, one_process_runtime, run_forked  # noqa: E402

WORLD = 2
STEPS = 3
COMMON = [
    "model=tiny",
    "model.n_layers=2",
    "training.seq_len=32",
    "training.global_batch=4",
    "training.micro_batch=2",
    "optim.warmup_steps=1",
    "optim.lr=1e-2",
    "precision=bf16",
    # Small NF4 blocks: the tiny model's row shards must hold whole scaler blocks (64 x 256 needs 16,384
    # elements a shard; its smallest projection has 2,048).
    "peft.nf4_block_size=16",
    "peft.nf4_scaler_block_size=4",
]
LAYOUTS = {"ddp": ["strategy=ddp"], "fsdp": ["strategy=zero3"]}
# One process against two, the same NF4 base and adapters: bf16 sums in another order. Measured: 1e-4
# (DDP), 1.3e-3 (FSDP2).
LAYOUT_TOL = 5e-3
# QLoRA against LoRA on the same run: the only difference is the NF4 rounding of the frozen base (4-bit
# codes, per-16-element absmax, double-quantised scales). Measured on this run: 3e-4 at most over the 3
# steps (the seeded base is random, so its logits are nearly flat and the rounding moves the loss little).
QLORA_VS_LORA_TOL = 3e-3


def train(method: str, overrides: list[str], world: int) -> dict:
    import torch
    import torch.distributed as dist

    from dtlaunch.config.compose import compose
    from dtlaunch.config.decisions import Decisions
    from dtlaunch.config.layout import Layout
    from dtlaunch.config.validate import validate
    from dtlaunch.models.nf4 import is_nf4
    from dtlaunch.train.parallel.frozen_base import convert_frozen_base
    from dtlaunch.train.parallel.process_group import DistEnv
    from dtlaunch.train.step import train_step

    cfg = compose([*COMMON, f"peft={method}", f"launch.nproc_per_node={world}", *overrides]).cfg
    validate(cfg)
    device = torch.device("cpu")
    torch.manual_seed(int(cfg.training.seed))
    t = cfg.training
    gb = Decisions.of(cfg, Layout.resolve(cfg.strategy, world)).global_batch

    def batches(dp_rank: int, dp_size: int) -> SeededBatches:
        return SeededBatches(gb, int(t.seq_len), int(t.micro_batch), dp_rank, dp_size, int(cfg.model.vocab_size))

    gathers: list = []
    if world > 1:
        from dtlaunch.train.runtime import build_runtime

        env = DistEnv(rank=dist.get_rank(), world=world, local_rank=0, restart=0, device=device, backend="gloo")
        rt = build_runtime(cfg, env)
        source = batches(dist.get_rank(), world)
        _record_all_gathers(gathers)
    else:
        # The worker's conversion of the frozen base (compute-dtype linears, NF4 block linears).
        rt = one_process_runtime(cfg, device, prepare=lambda m: convert_frozen_base(m, cfg, 1))
        source = batches(0, 1)
    model = getattr(rt.model_parts[0], "module", rt.model_parts[0])
    losses = []
    for step in range(1, STEPS + 1):
        loss = train_step(rt, source, step).local_loss.clone()
        if world > 1:
            dist.all_reduce(loss)
            loss /= world
        losses.append(float(loss))
    wq = model.layers["0"].attention.wq.weight
    out = {
        "loss": losses,
        "nf4": sum(is_nf4(getattr(p, "_local_tensor", p)) for p in model.parameters()),
        "wq": type(getattr(wq, "_local_tensor", wq)).__name__,
        "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
        "head_dtype": str(model.output.weight.dtype),
    }
    if gathers:
        out["gathers"] = gathers
        out["expected_block_gather_bytes"] = _block_gather_bytes(model, world)
    return out


def _record_all_gathers(log: list) -> None:
    """Wrap the all-gather FSDP2 calls with (dtype, bytes of the gathered buffer) per call."""
    import torch.distributed as dist

    orig = dist.all_gather_single

    def spy(output_tensor, input_tensor, *args, **kwargs):
        log.append([str(output_tensor.dtype), output_tensor.numel() * output_tensor.element_size()])
        return orig(output_tensor, input_tensor, *args, **kwargs)

    dist.all_gather_single = spy


def _block_gather_bytes(model, world: int) -> int:
    """What one block's all-gather must carry: every rank's NF4 codes and scales, other parameters in bf16."""
    from dtlaunch.models.nf4 import SHARDED_PARTS, is_nf4

    total = 0
    for p in model.layers["0"].parameters():
        local = p._local_tensor
        if is_nf4(local):
            total += sum(getattr(local, a).numel() * getattr(local, a).element_size() for a in SHARDED_PARTS)
        else:
            total += local.numel() * 2
    return total * world


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> dict:
    def run_all() -> dict:
        return {name: train("qlora", over, WORLD) for name, over in LAYOUTS.items()}

    return run_forked(WORLD, run_all, tmp_path_factory.mktemp("qlora") / "results.json")


@pytest.fixture(scope="module")
def one_process() -> dict:
    return {method: train(method, ["training.micro_batch=4"], 1) for method in ("qlora", "lora")}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_qlora_layout_matches_one_process(layout: str, launched: dict, one_process: dict) -> None:
    got, ref = launched[layout], one_process["qlora"]
    assert got["wq"] == ref["wq"] == "NF4Tensor"
    assert got["nf4"] == ref["nf4"] == 2 * 7  # every block linear of the 2 blocks
    assert got["trainable"] == ref["trainable"] and all(".lora_" in n for n in ref["trainable"])
    assert got["head_dtype"] == ref["head_dtype"] == "torch.bfloat16"  # the frozen head in the compute dtype
    assert max(abs(a - b) for a, b in zip(got["loss"], ref["loss"], strict=True)) <= LAYOUT_TOL, (got, ref)


@pytest.mark.slow
def test_fsdp_gathers_the_quantised_base(launched: dict) -> None:
    got = launched["fsdp"]
    # The blocks' gathers: uint8 buffers holding the NF4 bytes of all ranks plus bf16 adapters and norms,
    # in forward and again in backward (reshard after forward), for both blocks of each step. The frozen
    # embedding and head (units of their own) and the root unit (final norm) are not quantised: bf16.
    blocks = [size for dtype, size in got["gathers"] if dtype == "torch.uint8"]
    assert blocks and set(blocks) == {got["expected_block_gather_bytes"]}, got["gathers"]
    assert len(blocks) >= 2 * 2 * STEPS
    assert {dtype for dtype, _ in got["gathers"]} == {"torch.uint8", "torch.bfloat16"}


@pytest.mark.slow
def test_qlora_loss_stays_within_tolerance_of_lora(one_process: dict) -> None:
    q, lo = one_process["qlora"]["loss"], one_process["lora"]["loss"]
    assert one_process["lora"]["nf4"] == 0 and one_process["qlora"]["nf4"] == 2 * 7
    assert q != lo  # the base really is quantised
    assert q[-1] < q[0] and lo[-1] < lo[0], (q, lo)
    assert max(abs(a - b) for a, b in zip(q, lo, strict=True)) <= QLORA_VS_LORA_TOL, (q, lo)
