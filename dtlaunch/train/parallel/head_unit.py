"""The output head as an FSDP2 unit of its own: frozen (LoRA / QLoRA, DPO's reference copy) or trained and
untied under the chunked loss (full fine-tuning). Whether it is one is dtlaunch.config.decisions.head_unit's
decision, the planner's too; here it is taken from what the modules are (trained or frozen, tied, sharded
by tensor parallel), and checked against the config.

A trained head in the root unit would keep its unsharded gradient from the loss's backward to the root's
post-backward at the very end of backward, and (ZeRO-3) its gathered weight from the forward to then: on
Llama-3.1-70B about 2 GiB each. As its own unit (as torchtitan shards `output`), the chunked loss runs as
the unit's forward (dtlaunch.train.loss), so FSDP gathers the head only while the loss runs and
reduce-scatters its gradient at the unit's post-backward, right after the loss's backward. The final norm
stays in the root: the model's forward applies it outside the head.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.tensor import DTensor

from dtlaunch.config.decisions import head_unit

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def own_head_unit(model: nn.Module, cfg: JobConfig, tp: int, loss_chunks: int) -> list[nn.Module]:
    """[the output head] when it is an FSDP2 unit of its own on this stage, else []. `tp`: the layout's
    tensor-parallel degree; `loss_chunks`: the job's (config.decisions.Decisions.loss_chunks)."""
    head = getattr(model, "output", None)
    params = list(head.parameters()) if isinstance(head, nn.Module) else []
    trains = {p.requires_grad for p in params}
    if len(trains) != 1:
        return []  # no head on this stage, or one with adapters of its own on a frozen base: the root's
    others = {id(p) for name, mod in model.named_children() if name != "output" for p in mod.parameters()}
    tied = any(id(p) in others for p in params)
    tp_sharded = any(isinstance(p, DTensor) for p in params)
    # The planner decides from the config: the modules must say the same.
    assert tied == bool(getattr(cfg.model, "tie_embeddings", False)), (tied, cfg.model)
    assert tp_sharded == (tp > 1), (tp_sharded, tp)
    own = head_unit(trains == {True}, tied, owns_head=True, loss_chunks=loss_chunks, tp=2 if tp_sharded else 1)
    return [head] if own else []
