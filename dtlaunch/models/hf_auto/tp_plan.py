"""Tensor parallel for `model.arch=hf_auto`: the model's own `base_model_tp_plan` as dtlaunch.models.tp_styles.

transformers' config classes carry a plan for their decoder, module-name patterns ("layers.*.mlp.up_proj")
mapped to style names. The styles translate to torch's own (what transformers registers for them):
- "colwise": column-parallel, output sharded on the features (whole heads per rank for q/k/v);
- "rowwise": row-parallel, feature-sharded input, all-reduced output;
- "colwise_gather_output" / "rowwise_split_input": the same split with the output gathered / the input cut
  locally (Phi-3's fused qkv: every rank still sees all heads, so its attention's offsets stay right);
- "replicated_with_grad_allreduce" (Qwen3's per-head q/k norms): the weight stays replicated and its
  gradient is summed over the TP ranks, each of which saw only its heads (`SequenceParallel` on the head
  dimension does exactly that on DTensors, as in the native family's plan).
Any other style (packed, expert, MLA) or an entry outside the decoder layers is refused, with strategy.tp=1
as the fix. The head is column-parallel with vocabulary-sharded logits (the loss runs under loss_parallel);
a head tied to the embedding stays replicated, as does the embedding (the base plan leaves it whole).

Local heads: transformers' attention reshapes q/k/v with `view(..., -1, head_dim)` and keeps the ratio
num_heads / num_kv_heads for GQA, so sharded projections give the right local head count on their own;
attention modules that store a head count as an attribute get the local one (`localize_heads`). No
sequence parallel: the residual stream between the plan's modules is replicated.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

from dtlaunch.config.weight_source import hf_name
from dtlaunch.models.tp_styles import Colwise, Rowwise, SequenceShard, Style

if TYPE_CHECKING:
    from dtlaunch.config.schema import ModelConfig

LAYER_PREFIX = "layers.*."
# Projections whose output carries attention heads: sharding them column-wise splits the heads.
HEAD_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value")
SUPPORTED = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "replicated_with_grad_allreduce")
# Attributes under which attention modules of some architectures keep a head count.
HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads")


@lru_cache(maxsize=8)
def _hf_config(init_from: str) -> Any:

    from dtlaunch.hub.model_source import hf_source_dir
    from dtlaunch.models.hf_auto.build import _transformers

    return _transformers().AutoConfig.from_pretrained(str(hf_source_dir(init_from)), local_files_only=True)


def hf_plan(m: ModelConfig) -> dict[str, str]:
    """The decoder's plan transformers keeps for DIR's architecture ({} when it has none)."""
    return dict(getattr(_hf_config(str(m.init_from)), "base_model_tp_plan", None) or {})


def shards_heads(plan: dict[str, str]) -> bool:
    return any(k.rsplit(".", 1)[-1] in HEAD_PROJECTIONS and v == "colwise" for k, v in plan.items())


def check(m: ModelConfig, tp: int, sequence_parallel: bool) -> str | None:
    """Why `strategy.tp=tp` cannot run DIR's architecture (one line naming the fix), or None."""
    config = _hf_config(str(m.init_from))
    arch = ", ".join(getattr(config, "architectures", None) or [f"model_type={config.model_type}"])
    plan = hf_plan(m)
    if not plan:
        return f"strategy.tp={tp}: {arch} has no base_model_tp_plan in transformers (model.arch=hf_auto): use strategy.tp=1"
    for key, style in plan.items():
        if not key.startswith(LAYER_PREFIX):
            return f"strategy.tp={tp}: {arch}'s tensor-parallel plan shards {key} outside the decoder layers: use strategy.tp=1"
        if style not in SUPPORTED:
            return f"strategy.tp={tp}: {arch}'s tensor-parallel plan uses style '{style}' ({key}), which model.arch=hf_auto does not translate: use strategy.tp=1"
    if sequence_parallel:
        return (
            f"strategy.sequence_parallel=true: model.arch=hf_auto shards only what {arch}'s base_model_tp_plan names "
            f"(no sequence parallel): set strategy.sequence_parallel=false"
        )
    if shards_heads(plan):
        heads = int(config.num_attention_heads)
        kv = int(getattr(config, "num_key_value_heads", None) or heads)
        for key, value in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
            if value % tp:
                return (
                    f"strategy.tp={tp} does not divide {key}={value} of {hf_name(m.init_from)}/config.json (its "
                    f"tensor-parallel plan shards attention heads): choose a tp that divides it"
                )
    return None


def _style(name: str) -> Style:
    return {
        "colwise": Colwise(),
        "rowwise": Rowwise(),
        "colwise_gather_output": Colwise(output="replicate"),
        "rowwise_split_input": Rowwise(input="replicate"),
        # Input (B, S, heads on this rank, head_dim): "sharded" on the head dim, output back to local.
        "replicated_with_grad_allreduce": SequenceShard(dim=2, local_output=True),
    }[name]


def model_plan(m: ModelConfig, sequence_parallel: bool) -> dict[str, Any]:
    """The head: vocabulary-sharded logits (a DTensor for loss_parallel) unless it is the embedding's matrix."""
    if getattr(_hf_config(str(m.init_from)), "tie_word_embeddings", False):
        return {}
    return {"lm_head": Colwise(output="shard(-1)", local_output=False)}


def block_plan(m: Any, sequence_parallel: bool) -> dict[str, Any]:
    """Styles inside one decoder layer (names relative to the layer)."""
    return {key[len(LAYER_PREFIX) :]: _style(style) for key, style in hf_plan(m).items()}


def localize_heads(block: Any, m: Any, tp: int) -> None:
    """Attention modules of a layer that keep a head count as an attribute get this rank's count, when the
    plan splits heads (with gathered projections every rank computes all heads)."""
    if not shards_heads(hf_plan(m)):
        return
    for mod in block.modules():
        for attr in HEAD_ATTRS:
            value = mod.__dict__.get(attr)
            if isinstance(value, int) and not isinstance(value, bool) and value % tp == 0:
                setattr(mod, attr, value // tp)
