"""QLoRA (LoRA on an NF4 base, torchao) under DDP and FSDP2 against one process, and against LoRA.

Two gloo processes forked from pytest build the runtime object (build_runtime: LoRA adapters, NF4 base
quantised on meta, FSDP2 / DDP, init) and train the same seeded batches as one process with the same
conversions and no mesh. Every layout quantises the whole weight once (the shards are its rows), so the
layouts' losses agree with one process up to the order of sums. FSDP2's all-gathers of the blocks are
recorded: they carry uint8 buffers exactly as large as the ranks' NF4 codes and scales plus the adapters
and norms in bf16, never a bf16 copy of the base.

The Gated DeltaNet hybrids (qwen3_next, qwen3_5, qwen3_5_moe: their tiny Hugging Face directories,
tests/conftest.py) on one process: the Gated DeltaNet projections, the attention's and MLP's linears and the
router's gate are NF4, the shared expert's one-row gate and the routed experts stay bf16, only the adapters
(the experts' too, peft.target_experts) get gradients, and the losses equal LoRA's on the NF4-dequantised
weights. Qwen3-Next joins the forked group under FSDP2.
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

    from dtlaunch.config.decisions import Decisions
    from dtlaunch.config.layout import Layout
    from dtlaunch.job.compose import compose
    from dtlaunch.job.validate import validate
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


# The Gated DeltaNet hybrids; the MoE ones adapt their routed experts too, as the family matrix's LoRA does
# (tests/distributed/test_family_lifecycle.py).
HYBRIDS = {
    "qwen3_next": ["peft.target_experts=true"],
    "qwen3_5": [],
    "qwen3_5_moe": ["peft.target_experts=true"],
}
HYBRID_COMMON = [
    "model=tiny",
    "training.seq_len=32",
    "training.global_batch=4",
    "optim.warmup_steps=1",
    "optim.lr=1e-2",
    "precision=bf16",
    "peft.nf4_block_size=16",
    "peft.nf4_scaler_block_size=4",
]


def train_hybrid(path, method: str, world: int, extra: list[str], dequantised: bool = False) -> dict:
    """STEPS steps of a hybrid's directory under `method`, in 2 micro-batches of 2 (a DDP / FSDP rank's
    batch). One process converts its frozen base as the worker does; `dequantised`: the LoRA run's frozen
    block linears first take their NF4 round trip's values (what QLoRA's matmuls read)."""
    from forked_training import train as train_runtime

    from dtlaunch.train.parallel.frozen_base import convert_frozen_base

    family = path.name
    over = [*HYBRID_COMMON, f"model.init_from=hf:{path}", f"peft={method}", *HYBRIDS[family], *extra]
    over += [f"launch.nproc_per_node={world}", "training.micro_batch=2"]
    return train_runtime(
        over,
        world,
        STEPS,
        inspect=_hybrid_report,
        prepare=_dequantise_frozen_linears if dequantised else None,
        convert=lambda m, cfg: convert_frozen_base(m, cfg, 1),
    )


def _dequantise_frozen_linears(rt, _source) -> None:
    import torch
    from torch import nn

    from dtlaunch.models.nf4 import frozen_block_linears, to_nf4

    p = rt.cfg.peft
    for _, mod in frozen_block_linears(rt.model_parts[0]):
        w = mod.weight.detach()
        nf4 = to_nf4(w, int(p.nf4_block_size), int(p.nf4_scaler_block_size), w.dtype)
        with torch.no_grad():
            mod.weight = nn.Parameter(nf4.get_original_weight().to(w.dtype), requires_grad=False)


def _hybrid_report(rt) -> dict:
    """NF4 weights, the dtype of every other frozen weight, trainable parameters and frozen ones holding a
    gradient, by name."""
    from dtlaunch.models.nf4 import is_nf4

    model = rt.model_parts[0]
    out: dict = {"nf4": [], "frozen": {}, "trainable": [], "frozen_with_grad": []}
    for name, p in model.named_parameters():
        local = getattr(p, "_local_tensor", p)
        if p.requires_grad:
            out["trainable"].append(name)
        elif is_nf4(local):
            out["nf4"].append(name)
        else:
            out["frozen"][name] = str(local.dtype)
        if not p.requires_grad and p.grad is not None:
            out["frozen_with_grad"].append(name)
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
def hybrid_dirs(tiny_hf_dirs, tiny_moe_hf_dirs) -> dict:
    return {name: (tiny_hf_dirs if name == "qwen3_5" else tiny_moe_hf_dirs)[name] for name in HYBRIDS}


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory, hybrid_dirs: dict) -> dict:
    def run_all() -> dict:
        # One hybrid under FSDP2 (its NF4 Gated DeltaNet projections sharded by rows), first: the tiny
        # model's FSDP cell leaves its all-gather recorder installed.
        out = {"qwen3_next/fsdp": train_hybrid(hybrid_dirs["qwen3_next"], "qlora", WORLD, ["strategy=zero3"])}
        return {**out, **{name: train("qlora", over, WORLD) for name, over in LAYOUTS.items()}}

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


# The linears each hybrid's first block (Gated DeltaNet) stores in NF4: its projections, then the MLP.
GDN_NF4 = {
    "qwen3_next": ["in_proj_qkvz", "in_proj_ba", "out_proj"],
    "qwen3_5": ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"],
}
GDN_NF4["qwen3_5_moe"] = GDN_NF4["qwen3_5"]


@pytest.fixture(scope="module")
def hybrids_one_process(hybrid_dirs: dict) -> dict:
    return {
        name: {
            "qlora": train_hybrid(path, "qlora", 1, []),
            "lora_dequantised": train_hybrid(path, "lora", 1, [], dequantised=True),
        }
        for name, path in hybrid_dirs.items()
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", list(HYBRIDS))
def test_qlora_trains_the_hybrids_adapters_on_an_nf4_base(name: str, hybrids_one_process: dict) -> None:
    import math

    q, ref = hybrids_one_process[name]["qlora"], hybrids_one_process[name]["lora_dequantised"]
    report = q["inspect"]
    assert all(math.isfinite(x) for x in q["loss"]) and q["loss"][-1] < q["loss"][0], q["loss"]
    # Only the adapters train and hold gradients (the experts' own adapters too, on the MoE hybrids).
    assert report["trainable"] and all(".lora_" in n for n in report["trainable"]), report["trainable"]
    assert not report["frozen_with_grad"], report
    moe = name != "qwen3_5"
    assert any(".experts.lora_" in n for n in report["trainable"]) == moe
    # The Gated DeltaNet projections are NF4 (the default targets adapt none of them), and so is every
    # other frozen block linear of more than one row: the full-attention block's, the MLP's, the router's.
    nf4 = set(report["nf4"])
    assert {f"layers.0.attention.{lin}.weight" for lin in GDN_NF4[name]} <= nf4, sorted(nf4)
    assert {f"layers.1.attention.{lin}.weight" for lin in ("wq", "wk", "wv", "wo")} <= nf4, sorted(nf4)
    mlp = "feed_forward.shared_experts" if moe else "feed_forward"
    assert {f"layers.{i}.{mlp}.{w}.weight" for i in (0, 1) for w in ("w1", "w2", "w3")} <= nf4
    assert ("layers.0.feed_forward.router.gate.weight" in nf4) == moe
    frozen = report["frozen"]
    if moe:
        # The shared expert's one-row gate cannot be cut into FSDP row shards of NF4 blocks: bf16, as the
        # routed experts (3-D, the compute dtype, as under LoRA) are.
        assert frozen["layers.0.feed_forward.shared_gate.weight"] == "torch.bfloat16"
        assert {frozen[f"layers.0.feed_forward.experts.{w}"] for w in ("w1", "w2", "w3")} == {"torch.bfloat16"}
    # LoRA on the NF4 round trip of the same weights computes what QLoRA computes (measured: bit-identical).
    assert ref["inspect"]["nf4"] == [] and ref["inspect"]["trainable"] == report["trainable"]
    assert max(abs(a - b) for a, b in zip(q["loss"], ref["loss"], strict=True)) <= QLORA_VS_LORA_TOL, (q, ref)


@pytest.mark.slow
def test_qlora_hybrid_under_fsdp_matches_one_process(launched: dict, hybrids_one_process: dict) -> None:
    got, ref = launched["qwen3_next/fsdp"], hybrids_one_process["qwen3_next"]["qlora"]
    assert sorted(got["inspect"]["nf4"]) == sorted(ref["inspect"]["nf4"])
    assert got["inspect"]["trainable"] == ref["inspect"]["trainable"]
    assert max(abs(a - b) for a, b in zip(got["loss"], ref["loss"], strict=True)) <= LAYOUT_TOL, (got, ref)
