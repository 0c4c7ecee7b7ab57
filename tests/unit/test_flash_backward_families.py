"""CUDA's flash-attention backward buffers (dtlaunch.models.dense.activations.flash_backward_bytes, measured on an
H200: bench/results/gpu-2026-12-04-nvidia-h200.json) in every family that runs the same SDPA call: the MoE
decoders' attention is the dense block's, and a Gated DeltaNet hybrid's full-attention blocks are too. Attention
sinks (gpt-oss) and MLA (DeepSeek-V3, q/k and v of different widths) take other kernels: no term."""

from __future__ import annotations

import dataclasses

import pytest

from dtlaunch.commands.common import load_job
from dtlaunch.job.compose import compose
from dtlaunch.models.dense import activations as dense
from dtlaunch.models.registry import model_spec
from dtlaunch.plan.memory import plan_memory

HYBRID = ["model=llama3_8b", "model.arch=qwen3_5", "model.qk_norm=true"]


def _dims(overrides: list[str]):  # noqa: ANN202 (the family's own BlockDims)
    m = compose(overrides).cfg.model
    act = model_spec(m).act()
    return act, act.BlockDims.of(m), dense.BlockDims.of(m)


@pytest.mark.parametrize("model", ["model=qwen3_30b_a3b", "model=glm4_5_air", "model=mixtral_8x7b"])
def test_a_moe_blocks_attention_backward_is_the_dense_blocks(model: str) -> None:
    act, d, plain = _dims([model])
    for tp in (1, 2):
        assert act.flash_backward_bytes(d, 2, tp) == dense.flash_backward_bytes(plain, 2, tp) > 0


def test_attention_sinks_and_mla_state_no_flash_term() -> None:
    act, d, _ = _dims(["model=gpt_oss_20b"])
    assert act.flash_backward_bytes(d, 2, 1) is None
    act, _, _ = _dims(["model=deepseek_v3_671b"])
    assert getattr(act, "flash_backward_bytes", None) is None


def test_a_hybrids_full_attention_blocks_have_it_its_linear_blocks_not() -> None:
    act, d, plain = _dims(HYBRID)
    assert 0 < d.linear < 1
    assert act.flash_backward_bytes(d, 2, 1) == dense.flash_backward_bytes(plain, 2, 1) > 0
    assert act.flash_backward_bytes(dataclasses.replace(d, linear=1.0), 2, 1) is None


def test_a_moe_long_context_plan_on_a_gpu_profile_counts_the_kernels_buffers() -> None:
    """GLM-4.5-Air's width, 4 layers, 65,536 tokens, tiled MLPs: the flash backward is the block's largest
    backward moment on a GPU profile; the CPU's kernel keeps no fp32 accumulator (the same plan without it)."""
    long = ["model=glm4_5_air", "model.n_layers=4", "training.micro_batch=1", "training.seq_len=65536"]
    long += ["training.activation_checkpointing=full", "training.mlp_tiles=16", "training.loss_chunks=8"]
    long += ["training.activation_offload=false", "hardware=h200_141gb"]

    def peak(*more: str) -> float:
        job = load_job([*long, *more])
        return plan_memory(job.cfg, job.layout).peak

    gpu, cpu = peak(), peak("hardware.gpus_per_node=0")
    act, d, _ = _dims(long[:1])
    # The kernel's moment less the tiled experts' backward it replaces: over 20 KB a token at this width.
    assert gpu - cpu > 65536 * 20_000
    assert gpu - cpu < 65536 * act.flash_backward_bytes(d, 2, 1)
