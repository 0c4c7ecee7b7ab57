"""A trained, untied output head as an FSDP2 unit of its own under the chunked loss (full fine-tuning).

In the root unit the head's unsharded gradient waits from the loss's backward to the root's
post-backward at the very end of backward, and (ZeRO-3) its gathered weight stays from the forward to
then: on Llama-3.1-70B about 2 GiB each. As its own unit (as torchtitan shards `output`), the chunked
loss runs as the unit's forward (dtlaunch.train.chunked_loss), so FSDP gathers the head only while the
loss runs and reduce-scatters its gradient at the unit's post-backward, right after the loss's backward.
The final norm stays in the root: the model's forward applies it outside the head.

Only with a chunked loss (loss_chunks > 1: a full-vocabulary pass keeps its logits until backward
anyway) and without tensor parallel (its input / output styles would treat the loss as logits, as for
the frozen head: dtlaunch.train.parallel.frozen_base.chunked_head_unit). A head tied to the embedding
stays in the root with it.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor


def trained_head_unit(model: nn.Module, chunks: int) -> list[nn.Module]:
    """[the output head] when it trains, is untied and plain (no TP) and the loss is chunked; else []."""
    head = getattr(model, "output", None)
    params = list(head.parameters()) if isinstance(head, nn.Module) else []
    if chunks == 1 or not params or not all(p.requires_grad for p in params):
        return []
    if any(isinstance(p, DTensor) for p in params):
        return []
    shared = {id(p) for name, mod in model.named_children() if name != "output" for p in mod.parameters()}
    return [] if any(id(p) in shared for p in params) else [head]
