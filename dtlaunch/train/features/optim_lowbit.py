"""torchao's low-bit AdamW (`optim.name=adamw8bit|adamw4bit`): both moments block-quantised.

torchao quantises a state tensor only when the parameter's local tensor (an FSDP2 shard under FSDP) has
at least 4096 elements and divides by the block (256 elements for 8-bit, 128 for 4-bit); smaller ones
keep plain moments in the parameter's dtype. Its update (`single_param_adam`) is `torch.compile`d per
parameter shape, on CPU too. torchao keeps each group's lr as a tensor and refuses a float; torch's LR
schedulers fill that tensor in place.

One difference from torchao's own `step`: while a Python dispatch mode is active (the CPU memory
counter of the first steps, dtlaunch.train.observe.memtrack) torch.compile cannot trace, so the same
update function runs eagerly then.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

# optim.name -> torchao class name; the block sizes are torchao's defaults (the planner reads the same).
CLASSES = {"adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit"}
BLOCK_SIZES = {"adamw8bit": 256, "adamw4bit": 128}


def lowbit_adamw(groups: list[dict], cfg: JobConfig) -> torch.optim.Optimizer:
    import torchao.optim

    o = cfg.optim
    base = getattr(torchao.optim, CLASSES[str(o.name)])
    cls = type(base.__name__, (_EagerUnderDispatchMode, base), {})
    return cls(groups, lr=float(o.lr), betas=(float(o.beta1), float(o.beta2)), eps=float(o.eps))


class _EagerUnderDispatchMode:
    """Mixed into a torchao _AdamBase subclass (whose state layout and arithmetic it keeps)."""

    @torch.no_grad()
    def step(self, closure: Optional[Any] = None) -> Any:
        if _get_current_dispatch_mode() is None:
            return super().step(closure)  # type: ignore[misc]
        from torchao.optim.adam import single_param_adam

        for group in self.param_groups:  # type: ignore[attr-defined]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]  # type: ignore[attr-defined]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = self._new_buffer(p, True)  # type: ignore[attr-defined]
                    state["exp_avg_sq"] = self._new_buffer(p, False)  # type: ignore[attr-defined]
                state["step"] += 1
                single_param_adam(
                    p.detach(),
                    p.grad,
                    state["step"],
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    None,
                    group["lr"],
                    group["betas"][0],
                    group["betas"][1],
                    group["weight_decay"],
                    group["eps"],
                    self.is_adamw,  # type: ignore[attr-defined]
                    self.bf16_stochastic_round and p.dtype is torch.bfloat16,  # type: ignore[attr-defined]
                )
        return None
