"""Float8 training of the blocks' linears through torchao (`precision.float8=tensorwise|rowwise`).

Validation refuses float8 on hardware profiles without float8 tensor cores; this is the runtime's own
check of the device it actually got (a job planned for an H100 that lands on an A100), then the swap
of every block linear for torchao's Float8Linear. It runs on the meta model before any other
parallelisation, as torchao expects. The output head stays in bf16 (its logits feed the loss), and
linears whose dimensions are not multiples of 16 (float8 matmul kernels need that) are skipped.

`precision.float8_emulate=true` is the test path: torchao's emulated matmuls (the same casts and
scales, the float8 products computed in fp32) on any device, CPU included, with no speed-up.

Parallelism (tensorwise scaling only, as torchao supports it): under FSDP2 the converted weights are
all-gathered in float8 (half of bf16's bytes) and their scales computed for all of them in one
all-reduce after each optimizer step (`scale_precompute`); under tensor parallel the styles of the
converted linears become torchao's float8 styles (`float8_tp_plan`), so activations are all-gathered
in float8 too. Rowwise scaling uses the plain styles and gathers in bf16, as torchtitan does.
torchao is imported only here: `pip install 'dtlaunch[float8]'`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
from torch import nn

from dtlaunch.errors import ConfigError

MIN_CAPABILITY = (8, 9)  # Ada / Hopper and newer
HEAD_NAMES = ("output", "lm_head")  # the native decoder's head, a transformers model's (model.arch=hf_auto)


def apply_float8(model: nn.Module, precision: Any, device: torch.device, fsdp: bool = False) -> None:
    """Swap the eligible linears of `model` for torchao's Float8Linear (no-op for float8=none).

    `fsdp`: the model will be sharded by FSDP2, so tensorwise weights are all-gathered in float8."""
    recipe, emulate = str(precision.float8), bool(getattr(precision, "float8_emulate", False))
    if recipe == "none":
        return
    if not emulate:
        check_device(recipe, device)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as exc:
        raise ConfigError(
            f"precision.float8={recipe} needs torchao, which is not installed: pip install 'dtlaunch[float8]'"
        ) from exc
    config = Float8LinearConfig.from_recipe_name(recipe)
    config = dataclasses.replace(config, emulate=emulate, enable_fsdp_float8_all_gather=fsdp and recipe == "tensorwise")
    convert_to_float8_training(model, config=config, module_filter_fn=_convert)


def check_device(recipe: str, device: torch.device) -> None:
    if device.type != "cuda":
        raise ConfigError(f"precision.float8={recipe} needs a CUDA GPU with float8 tensor cores, not {device.type}")
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        raise ConfigError(
            f"precision.float8={recipe} needs float8 tensor cores (compute capability 8.9+); "
            f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}: set precision.float8=none"
        )


def _convert(module: Any, fqn: str) -> bool:
    if not isinstance(module, nn.Linear) or fqn.split(".")[-1] in HEAD_NAMES:
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def float8_tp_plan(plan: dict[str, Any], module: nn.Module) -> dict[str, Any]:
    """`plan` (names relative to `module`) with torchao's float8 styles where tensorwise float8 applies:
    column/row-wise styles on converted linears, and input preparation of a module whose linears are all
    converted (its input is cast once, then all-gathered in float8 for every consumer)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    def tensorwise(m: nn.Module) -> bool:
        return isinstance(m, Float8Linear) and m.config.cast_config_input.scaling_granularity.value == "tensorwise"

    from dtlaunch.train.parallel.tp_restyle import restyle

    def swap(target: nn.Module, name: str, style: Any) -> Any:
        kind = type(style)
        # Row-wise with a replicated input (cut locally) stays plain: torchao's style expects Shard(-1).
        standard = kind is ColwiseParallel or (kind is RowwiseParallel and style.input_layouts[0] == Shard(-1))
        if standard and tensorwise(target):
            twin = Float8ColwiseParallel if kind is ColwiseParallel else Float8RowwiseParallel
            return twin(
                input_layouts=style.input_layouts[0],
                output_layouts=style.output_layouts[0],
                use_local_output=style.use_local_output,
            )
        if kind is PrepareModuleInput and _all_linears_tensorwise(target, tensorwise):
            return PrepareFloat8ModuleInput(
                input_layouts=style.input_layouts,
                desired_input_layouts=style.desired_input_layouts,
                input_kwarg_layouts=style.input_kwarg_layouts or None,
                desired_input_kwarg_layouts=style.desired_input_kwarg_layouts or None,
                use_local_output=style.use_local_output,
            )
        return style

    return restyle(plan, module, swap)


def _all_linears_tensorwise(module: nn.Module, tensorwise: Callable[[nn.Module], bool]) -> bool:
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    return bool(linears) and all(tensorwise(m) for m in linears)


def scale_precompute(model_parts: list[nn.Module]) -> Optional[Callable[[], None]]:
    """After each optimizer step: the float8 scales of every FSDP-sharded float8 weight in one all-reduce
    (torchao then skips the per-weight amax all-reduce before each all-gather). None when no weight is
    all-gathered in float8. Once set, a precomputed scale is used until the next one, so it must run after
    every step that changes the weights."""
    if not any(_gathers_float8(m) for part in model_parts for m in part.modules()):
        return None
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    def run() -> None:
        for part in model_parts:
            precompute_float8_dynamic_scale_for_fsdp(part)

    return run


def _gathers_float8(m: nn.Module) -> bool:
    config = getattr(m, "config", None)
    return type(m).__name__ == "Float8Linear" and bool(getattr(config, "enable_fsdp_float8_all_gather", False))
