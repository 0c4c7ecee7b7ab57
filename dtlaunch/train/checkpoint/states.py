"""What a checkpoint holds, as `Stateful` containers (torch.distributed.checkpoint.stateful.Stateful):
DCP's `save` calls their `state_dict()`, its `load` calls `state_dict()` for the template, reads into it,
then `load_state_dict()`.

- `ModelState`: every model part's parameters under the full model's names (DDP, FSDP2, TP DTensors and
  pipeline stages alike: `get_model_state_dict`), one dict over the parts of this rank;
- `OptimizerState`: their optimizers' state, flattened to `state.<fqn>.<key>` / `param_groups.<fqn>.<key>`
  so that parts merge and any layout reshards it (ZeRO-1: the inner optimizer's entries of the parameters
  this rank owns; the union over ranks is the full state);
- `SchedulerState`: the LR schedulers, plain numbers kept in the JSON trainer state (never pickle).

The checkpoint manager keeps them in one dict (`train_states`) and saves it.
"""

from __future__ import annotations

import sys
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful

from dtlaunch.errors import ConfigError
from dtlaunch.models.saved_tensors import saved_model_tensors


class ModelState(Stateful):
    """trainable_only (peft): the frozen base is not copied into checkpoints (it is re-read from its source,
    whose fingerprint the marker records); only the parameters that train are saved and loaded."""

    def __init__(self, model_parts: list, trainable_only: bool = False) -> None:
        self.model_parts = list(model_parts)
        self.trainable_only = trainable_only
        self._keys: list[list[str]] = []

    def _options(self) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(ignore_frozen_params=self.trainable_only, strict=not self.trainable_only)

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        out: dict[str, Any] = {}
        self._keys = []
        for part in self.model_parts:
            sd = get_model_state_dict(part, options=self._options())
            # The entries saved are the names saved_model_tensors gives, the same the launcher's resume
            # check expects (torch alone would keep a frozen tied head under its second name).
            sd = {k: sd[k] for k in saved_model_tensors(part, self.trainable_only)}
            self._keys.append(list(sd))
            out.update(sd)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        if not self._keys:  # which entries belong to which part
            self.state_dict()
        for part, keys in zip(self.model_parts, self._keys, strict=True):
            set_model_state_dict(part, {k: state_dict[k] for k in keys}, options=self._options())


class OptimizerState(Stateful):
    """One optimizer per model part (or none: nothing is saved)."""

    def __init__(self, model_parts: list, optimizers: list) -> None:
        self.optimizers = list(optimizers)
        self.model_parts = list(model_parts) if self.optimizers else []
        self._keys: list[list[str]] = []

    def _options(self) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        out: dict[str, Any] = {}
        self._keys = []
        for part, opt in zip(self.model_parts, self.optimizers, strict=True):
            local = _local_optimizer(opt)
            if local is not opt:
                _sync_zero_param_groups(opt, to_inner=True)
            sd = get_optimizer_state_dict(part, [local], options=self._options())
            self._keys.append(list(sd))
            out.update(sd)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        if not self._keys:
            self.state_dict()
        for part, opt, keys in zip(self.model_parts, self.optimizers, self._keys, strict=True):
            local = _local_optimizer(opt)
            set_optimizer_state_dict(part, [local], {k: state_dict[k] for k in keys}, options=self._options())
            if local is not opt:
                _sync_zero_param_groups(opt)


class SchedulerState(Stateful):
    """One LR scheduler per model part, all stepped together: any saved one fits every part, so a run
    with 2 pipeline stages per rank resumes on 1 (or none) and back."""

    def __init__(self, schedulers: list) -> None:
        self.schedulers = list(schedulers)

    def state_dict(self) -> dict[str, Any]:
        return {"schedulers": [_plain(s.state_dict()) for s in self.schedulers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict["schedulers"]
        if any(sd != saved[0] for sd in saved[1:]):
            raise ConfigError("the checkpoint holds LR schedulers in different states: it is damaged")
        for sched in self.schedulers:
            sched.load_state_dict(_fit_groups(saved[0], len(sched.optimizer.param_groups)))


def _fit_groups(sd: dict[str, Any], groups: int) -> dict[str, Any]:
    """The saved scheduler's per-group lists fitted to this optimizer's number of groups. Every group follows
    the one schedule from the one optim.lr, but a layout decides how many groups there are (a tensor-parallel
    plan that leaves some parameters plain splits a group by kind: dtlaunch.train.optim.param_groups), so a
    checkpoint of another layout may have more or fewer."""
    out = dict(sd)
    for key in ("base_lrs", "_last_lr"):
        values = sd.get(key)
        if not isinstance(values, list) or len(values) == groups or not values:
            continue
        if any(v != values[0] for v in values[1:]):
            raise ConfigError(
                f"the checkpoint's LR scheduler has {len(values)} parameter groups at different rates and this "
                f"layout has {groups}: resume with the layout that wrote it"
            )
        out[key] = [values[0]] * groups
    return out


def _plain(sd: dict[str, Any]) -> dict[str, Any]:
    """Tensor lrs (torchao's optimizers keep lr as a tensor) as the plain numbers JSON holds."""
    import torch

    def plain(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.item()
        return [plain(x) for x in v] if isinstance(v, list) else v

    return {k: plain(v) for k, v in sd.items()}


def train_states(
    model_parts: list, optimizers: list, schedulers: list, trainable_only: bool = False
) -> dict[str, Stateful]:
    """The checkpoint's states by name; "model" and "optim" go through DCP, "schedulers" into JSON."""
    return {
        "model": ModelState(model_parts, trainable_only),
        "optim": OptimizerState(model_parts, optimizers),
        "schedulers": SchedulerState(schedulers),
    }


def _local_optimizer(opt: Any) -> Any:
    """ZeRO-1 (ZeroRedundancyOptimizer): its inner optimizer holds the state of the parameters this rank
    owns. Saved flat by parameter name, each owned entry exists on exactly one rank, so the union over ranks
    is the full optimizer state - loadable by any layout, and loadable from any layout (each rank reads
    the entries of the parameters it owns). The wrapper's own state_dict would need a consolidation onto
    one rank first."""
    # Only a run that built a ZeroRedundancyOptimizer has imported its module: every other run's first save
    # would import torch.distributed.optim (RPC, ~0.3-1 s) for this isinstance check alone.
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return opt.optim if zero is not None and isinstance(opt, zero.ZeroRedundancyOptimizer) else opt


def _sync_zero_param_groups(opt: Any, to_inner: bool = False) -> None:
    """ZeroRedundancyOptimizer copies its own param_groups' hyper-parameters into the inner optimizer only
    at the start of each step, so the inner lr lags the scheduler by one step. Save the wrapper's current
    values (to_inner=True before saving) and give them back to the wrapper after loading."""
    for outer, inner in zip(opt.param_groups, opt.optim.param_groups, strict=True):
        src, dst = (outer, inner) if to_inner else (inner, outer)
        for key, value in src.items():
            if key != "params":
                dst[key] = value
