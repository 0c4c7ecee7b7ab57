"""objective=reward's scalar head: the decoder's LM head (`output`) gives way to `score`, a Linear(dim, 1,
bias=False) under the name and shape of transformers' *ForSequenceClassification head. One definition for the
worker (dtlaunch.train.runtime, which trains it: dtlaunch.train.objectives.reward) and the launcher's resume
check (dtlaunch.launch.preflight), which must list the same tensors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch-free at import: the exporter and the planner's paths read SCORE_HEAD only
    import torch
    from torch import nn

# The head's parameter, under transformers' own name. A causal LM's weights (model.init_from=hf:DIR) do not
# hold it: it starts from the seeded init, as transformers initialises a new `score`.
SCORE_HEAD = "score.weight"
# The head trains in full beside LoRA adapters (peft's modules_to_save, TRL's advice for a reward model).
SCORE_MODULE = "score"


def add_score_head(model: nn.Module) -> tuple[str, ...]:
    """Replace the decoder's LM head by the scalar `score` head, on the model's device (meta before
    parallelize: the runtime initialises it with the other parameters, by name). The head runs inside the
    model's forward (a forward hook), so under FSDP the root unit's weights are gathered when it runs, and
    the forward returns (rows, positions, 1) scores: no (tokens x vocabulary) logits ever exist. Returns the
    modules that train in full under LoRA (dtlaunch.models.lora.apply_lora's modules_to_save)."""
    from torch import nn

    device = model.norm.weight.device
    model.output = None  # the forward then returns the final norm's output (a tied embedding stays)
    model.score = nn.Linear(int(model.cfg.dim), 1, bias=False, device=device)
    model.register_forward_hook(_apply_score)
    return (SCORE_MODULE,)


def _apply_score(module: nn.Module, args: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The decoder's normed hidden states (R, S, dim) -> scores (R, S, 1)."""
    return module.score(hidden)
