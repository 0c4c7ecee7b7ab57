"""The Gated DeltaNet hybrids (qwen3_next, qwen3_5, qwen3_5_moe) split by key heads over 2 forked gloo ranks
(dtlaunch/models/qwen3_next/tp_plan.py) train as one process: losses and grad norms of every step within
1e-4, and every gradient of the first step (gathered from its shards) within 1e-5 of its largest entry (plus
an fp32 noise floor, NOISE), the linear block's included: Qwen3-Next's fused in_proj_qkvz / in_proj_ba and Qwen3.5's split projections
(in_proj_qkv split on its rows, gathered and computed in per-head slices), conv1d, A_log / dt_bias, the gated norm's
shared gain and out_proj. With sequence parallel and without, over packed documents (each linear block's
state and convolution reset at every document on the split heads), and under FSDP2 x TP (4 ranks, qwen3_5: in_proj_qkv and conv1d
row-split DTensors on the TP mesh gathered per forward, sharded again by FSDP over the data ranks). The tiny directories of tests/conftest.py:
2 key heads serving 4 value heads, so each rank holds one key head and its two value heads.

Reuses test_mla_tensor_parallel.py's recording of the first gradients."""

from __future__ import annotations

import pytest
from forked_training import SeededBatches, run_forked, train
from test_mla_tensor_parallel import GRAD_TOL, TOL, _record_first_grads

pytestmark = [
    pytest.mark.slow,
    pytest.mark.slow_reason(
        "a forked group of 2 trains 4 TP layouts of the three hybrid families, one of 4 FSDP2 x TP"
    ),
]

STEPS = 2
# fp32 rounding: the gradients' absolute differences are 1e-9 to 2e-8 (a different order of the same sums)
# wherever they are compared. The decay path's (A_log, dt_bias, in_proj_a: ~1e-5, some 300 times smaller than
# the rest, sums of terms that largely cancel) then differs by 1-2e-4 of its own largest entry on qwen3_5_moe;
# so an absolute floor besides GRAD_TOL, still ~1e-3 of those entries (a wrong split errs by their size).
NOISE = 1e-8
SMALL = [
    "model=tiny",
    "hardware=cpu",
    "precision=fp32",
    "training.seq_len=16",
    "training.micro_batch=4",
    "training.global_batch=4",
    "optim.warmup_steps=1",
    "optim.lr=1e-2",
    "training.grad_clip=0.5",
]
# name -> (family, sequence parallel, peft overrides)
CASES = {
    "qwen3_next_sp": ("qwen3_next", True, ()),
    "qwen3_next_no_sp": ("qwen3_next", False, ()),
    "qwen3_5_sp": ("qwen3_5", True, ()),
    "qwen3_5_moe_no_sp": ("qwen3_5_moe", False, ()),
    # LoRA on every linear of Qwen3-Next (its fused projections column-parallel, out_proj row-parallel); alpha
    # so the adapters move the loss. Adapters' gradients compared at the second step (lora_b starts at 0).
    "qwen3_next_lora_all_linear_sp": ("qwen3_next", True, ("peft=lora", "peft.alpha=32", "peft.targets=[all-linear]")),
}
# Packed documents under TP (data.document_mask's model inputs): each row three documents, each linear
# block's convolution and state reset at their starts on the split heads as on the whole ones.
DOCUMENTS = {"qwen3_next_documents_sp": ("qwen3_next", True, ())}
DOC_LENGTHS = (5, 7, 4)  # training.seq_len=16


class PackedDocuments(SeededBatches):
    """SeededBatches whose rows each hold the documents DOC_LENGTHS: their positions restart at each
    document and their document ids keep attention (and the Gated DeltaNet state) inside each one."""

    def __init__(self, *args) -> None:
        import torch

        super().__init__(*args)
        doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(DOC_LENGTHS)])
        positions = torch.cat([torch.arange(n) for n in DOC_LENGTHS])
        self.documents = {
            "positions": positions.expand(self.micro_batch, -1).clone(),
            "doc_ids": doc_ids.expand(self.micro_batch, -1).clone(),
        }

    def next_batch(self):
        import dataclasses

        return dataclasses.replace(super().next_batch(), model_args=self.documents)


def packed_documents(cfg, global_batch, dp_rank, dp_size, cp_rank, cp_size) -> PackedDocuments:
    t = cfg.training
    return PackedDocuments(
        global_batch, int(t.seq_len), int(t.micro_batch), dp_rank, dp_size, int(cfg.model.vocab_size)
    )


# The linear block's parameters (block 0) each family must have compared.
LINEAR = {
    "qwen3_next": ("in_proj_qkvz", "in_proj_ba", "conv1d", "A_log", "dt_bias", "norm", "out_proj"),
    "qwen3_5": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm", "out_proj"),
}


@pytest.fixture(scope="module")
def dirs(tiny_hf_dirs, tiny_moe_hf_dirs) -> dict:
    every = {**tiny_hf_dirs, **tiny_moe_hf_dirs}
    return {case[0]: every[case[0]] for case in CASES.values()}


def _model(path) -> list[str]:
    return [*SMALL, f"model.init_from=hf:{path}"]


def _run(overrides: list[str], world: int, documents: bool = False) -> dict:
    batches = packed_documents if documents else None
    return train(
        overrides, world, STEPS, inspect=lambda rt: rt.first_grads, prepare=_record_first_grads, make_batches=batches
    )


def _save_dcp(where: str):
    def inspect(rt) -> str:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        dcp.save(get_model_state_dict(rt.model_parts[0]), checkpoint_id=where)
        return where

    return inspect


@pytest.fixture(scope="module")
def launched(dirs, tmp_path_factory) -> dict:
    saved = str(tmp_path_factory.mktemp("gated_deltanet_tp_dcp"))

    def run_all() -> dict:
        out = {}
        for name, (family, sp, peft) in {**CASES, **DOCUMENTS}.items():
            tp = ["strategy=tp", "launch.nproc_per_node=2", f"strategy.sequence_parallel={str(sp).lower()}"]
            out[name] = _run([*_model(dirs[family]), *peft, *tp], 2, documents=name in DOCUMENTS)
        # The loaded weights, before any step, saved by DCP from the TP shards (test_checkpoint_...).
        for family in ("qwen3_next", "qwen3_5"):
            tp = ["strategy=tp", "launch.nproc_per_node=2", "strategy.sequence_parallel=true"]
            out[f"dcp_{family}"] = train([*_model(dirs[family]), *tp], 2, 0, inspect=_save_dcp(f"{saved}/{family}"))
        return out

    return run_forked(2, run_all, tmp_path_factory.mktemp("gated_deltanet_tp") / "results.json")


# FSDP2 over 2 data-parallel ranks x TP 2, each rank's micro-batch of 2: the one-process batch of 4.
FSDP_TP = ["strategy=fsdp_tp", "launch.nproc_per_node=4", "training.micro_batch=2"]


@pytest.fixture(scope="module")
def launched_fsdp_tp(dirs, tmp_path_factory) -> dict:
    def run_all() -> dict:
        return _run([*_model(dirs["qwen3_5"]), *FSDP_TP], 4)

    return run_forked(4, run_all, tmp_path_factory.mktemp("gated_deltanet_fsdp_tp") / "results.json")


@pytest.mark.parametrize("name", [*CASES, *DOCUMENTS, "qwen3_5_fsdp_tp"])
def test_tensor_parallel_gated_deltanet_trains_as_one_process(name: str, dirs, request) -> None:
    fsdp_tp = name == "qwen3_5_fsdp_tp"
    family, _, peft = ("qwen3_5", True, ()) if fsdp_tp else {**CASES, **DOCUMENTS}[name]
    got = request.getfixturevalue("launched_fsdp_tp") if fsdp_tp else request.getfixturevalue("launched")[name]
    want = _run([*_model(dirs[family]), *peft, "launch.nproc_per_node=1"], 1, documents=name in DOCUMENTS)
    if name in DOCUMENTS:  # the documents matter: the same rows unpacked train otherwise
        plain = _run([*_model(dirs[family]), "launch.nproc_per_node=1"], 1)
        assert abs(plain["loss"][0] - want["loss"][0]) > 1e-3, (plain["loss"], want["loss"])
    assert want["loss"][-1] < want["loss"][0], want  # the steps move the weights
    for key in ("loss", "grad_norm"):
        diff = max(abs(a - b) for a, b in zip(got[key], want[key], strict=True))
        assert diff <= TOL, f"{key}: max abs diff {diff:.3g}: {got[key]} vs {want[key]}"
    assert got["inspect"].keys() == want["inspect"].keys()
    linear = {n for n in want["inspect"] if n.startswith("layers.0.attention.")}
    parts = LINEAR["qwen3_next" if family == "qwen3_next" else "qwen3_5"]
    if peft:  # only the adapters have gradients: the linear block's linears'
        parts = tuple(p for p in parts if p.startswith(("in_proj", "out_proj")))
    assert {n.split(".")[3] for n in linear} == set(parts), sorted(linear)
    for param, g in want["inspect"].items():
        scale = max(abs(x) for x in g)
        diff = max(abs(a - b) for a, b in zip(got["inspect"][param], g, strict=True))
        assert scale > 0 and diff <= GRAD_TOL * scale + NOISE, (
            f"{param}: max abs diff {diff:.3g}, largest entry {scale:.3g}"
        )


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_checkpoint_of_the_tp_shards_is_one_process_state(family: str, dirs, launched, tmp_path) -> None:
    """DCP's checkpoint of the TP(2) shards (fused / split input projections on their rows, conv1d and
    in_proj_qkv row splits of the one-process layout, A_log / dt_bias by head) holds, by name, the one
    process's loaded tensors bit for bit."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(launched[f"dcp_{family}"]["inspect"], tmp_path / "model.pt")
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    one = train([*_model(dirs[family]), "launch.nproc_per_node=1"], 1, 0, inspect=lambda rt: rt.model_parts[0])
    want = one["inspect"].state_dict()
    assert saved.keys() == want.keys()
    assert any(".attention.conv1d." in n for n in want)
    for name, t in want.items():
        assert torch.equal(saved[name], t), name
