"""A model family from outside dtlaunch (`model.arch=toy model.family_module=toyfam`): a residual MLP
language model. Importing this registers it; like dtlaunch's own families it imports no torch here."""

from dtlaunch.models.registry import ModelSpec, register
from toyfam.config import ToyConfig


def _block(m) -> int:  # norm gain + up [r*d, d] + down [d, r*d]
    return m.dim + 2 * m.mlp_ratio * m.dim * m.dim


def _count(m) -> int:
    return 2 * m.vocab_size * m.dim + m.n_layers * _block(m) + m.dim


SPEC = register(
    ModelSpec(
        arch="toy",
        description="a residual MLP language model (test plug-in)",
        builder="toyfam.model:build_model",
        tp_plan="toyfam.tp_plan",
        pipeline_split="",
        hf_architectures=(),
        hf=None,
        hf_names="",
        param_count=_count,
        block_params=_block,
        block_norm_params=lambda m: m.dim,
        embedding_params=lambda m: m.vocab_size * m.dim,
        head_params=lambda m: m.vocab_size * m.dim,
        flops_per_token=lambda m, seq_len: 6.0 * _count(m),
        matmul_params=_count,
        tp_divisors=lambda m: [("model.dim", m.mlp_ratio * m.dim), ("model.vocab_size", m.vocab_size)],
        activations=None,  # no closed-form memory model: the planner traces one step
        ring_attention=False,
        config=ToyConfig,  # model.mlp_ratio: a field only this family has
    )
)
