"""A peft LoRA adapter directory (`generate --adapter DIR`), checked from adapter_config.json and the
safetensors header against the base's weight headers, before any tensor is read: every tensor a
lora_A [r, in] / lora_B [out, r] of a module the base has, with the config's r and the base's sizes;
every target_modules entry naming modules the base has. peft refuses these mismatches too; merging
anyway would apply a scale alpha/r the adapter was not trained with, or silently nothing."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from dtlaunch.errors import InputError
from dtlaunch.inputs.json_file import read_json_object
from dtlaunch.inputs.safetensors_header import read_header

# peft's adapter directory: the tensors, their config, and the prefix peft puts before each module name.
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."


def read_adapter_config(path: Path) -> dict:
    """adapter_config.json with the keys merging reads, typed: a plain LoRA with one r and one alpha."""
    where = f"--adapter {path}"
    cfg_file, file = path / ADAPTER_CONFIG, path / ADAPTER_FILE
    if not cfg_file.is_file() or not file.is_file():
        raise InputError(f"{where}: needs {ADAPTER_CONFIG} and {ADAPTER_FILE}: give a peft LoRA adapter directory")
    c = read_json_object(cfg_file, f"{where}: {ADAPTER_CONFIG}")
    if c.get("peft_type") != "LORA" or c.get("use_dora") or c.get("fan_in_fan_out"):
        raise InputError(
            f"{where}: only plain LoRA adapters are supported (peft_type LORA, no DoRA, no fan_in_fan_out)"
        )
    r, alpha = c.get("r"), c.get("lora_alpha")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise InputError(f"{where}: {ADAPTER_CONFIG} has r={json.dumps(r)[:40]}, not a rank >= 1: restore it")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise InputError(
            f"{where}: {ADAPTER_CONFIG} has lora_alpha={json.dumps(alpha)[:40]}, not a finite number: restore it"
        )
    if not isinstance(c.get("use_rslora", False), bool):
        raise InputError(
            f"{where}: {ADAPTER_CONFIG} has use_rslora={json.dumps(c['use_rslora'])[:20]}: use true or false"
        )
    for key in ("rank_pattern", "alpha_pattern"):
        if c.get(key):
            # Per-module ranks or alphas would need a scale per module; one scale for all is not what peft applies.
            raise InputError(f"{where}: {ADAPTER_CONFIG} sets {key}, which dtlaunch does not apply: merge it with peft")
    dropout = c.get("lora_dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout <= 1:
        raise InputError(f"{where}: {ADAPTER_CONFIG} has lora_dropout={json.dumps(dropout)[:20]}, not in [0, 1]")
    targets = c.get("target_modules")
    if not (
        isinstance(targets, str) or (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets))
    ):
        raise InputError(
            f"{where}: {ADAPTER_CONFIG} has target_modules={json.dumps(targets)[:60]}, neither a list of module "
            "names nor a regular expression: restore it"
        )
    return c


def _targeted(module: str, targets: Any) -> bool:
    """peft's rule: a list entry matches a module of that name or ending in '.<entry>'; a string is a
    regular expression matched against the whole module name."""
    if isinstance(targets, str):
        if targets == "all-linear":
            return True
        try:
            return re.fullmatch(targets, module) is not None
        except re.error:
            return False
    return any(module == t or module.endswith("." + t) for t in targets)


def check_adapter_dir(path: Path, base: dict[str, tuple[str, tuple[int, ...]]]) -> dict:
    """adapter_config.json (checked, returned) against the adapter's tensors and the base's weight
    headers `base` ({HF name: (dtype, shape)})."""
    where = f"--adapter {path}"
    c = read_adapter_config(path)
    r, targets = c["r"], c["target_modules"]
    if c.get("task_type") == "SEQ_CLS":  # a reward model's adapters and score head (objective=reward)
        raise InputError(
            f"{where}: a sequence-classification adapter (task_type SEQ_CLS, a reward model's) scores text and "
            "generates none: give a causal LM's adapter, or load it with peft onto AutoModelForSequenceClassification"
        )
    if isinstance(targets, str) and targets != "all-linear":
        try:
            re.compile(targets)
        except re.error as exc:
            raise InputError(f"{where}: target_modules '{targets[:60]}' is not a regular expression ({exc})") from None
    header = read_header(path / ADAPTER_FILE, "restore the adapter (it is spoiled or was cut short while copying)")
    if not header:
        raise InputError(f"{where}: {ADAPTER_FILE} holds no tensors: give a trained adapter")
    modules = {n[: -len(".weight")] for n, (_, s) in base.items() if n.endswith(".weight") and len(s) == 2}
    for name, (_, shape) in sorted(header.items()):
        parts = name.split(".")
        if (
            not name.startswith(PEFT_PREFIX)
            or len(parts) < 5
            or parts[-1] != "weight"
            or parts[-2] not in ("lora_A", "lora_B")
        ):
            raise InputError(f"{where}: tensor {name[:100]} is not a LoRA adapter weight (peft's lora_A / lora_B)")
        module = ".".join(parts[2:-2])
        if module not in modules:
            raise InputError(
                f"{where}: tensor {name[:100]} adapts module {module}, which the base has not: give the adapter "
                "of this base model"
            )
        if not _targeted(module, targets):
            raise InputError(
                f"{where}: tensor {name[:100]} adapts {module}, which target_modules {json.dumps(targets)[:80]} in "
                f"{ADAPTER_CONFIG} does not name: restore the adapter's {ADAPTER_CONFIG}"
            )
        out_dim, in_dim = base[module + ".weight"][1]
        is_a = parts[-2] == "lora_A"
        want = (r, in_dim) if is_a else (out_dim, r)
        if len(shape) == 2 and (shape[1] if is_a else shape[0]) == (in_dim if is_a else out_dim):
            rank = shape[0] if is_a else shape[1]
            if rank != r:
                raise InputError(
                    f"{where}: {ADAPTER_CONFIG} says r={r} but {name[:100]} has rank {rank}: the scale alpha/r would "
                    f"be wrong; set r to {rank} (the rank it was trained with) in {ADAPTER_CONFIG}"
                )
        if tuple(shape) != want:
            raise InputError(
                f"{where}: {name[:100]} has shape {list(shape)}, the base's {module} needs {list(want)} with r={r}: "
                "the adapter belongs to another base model"
            )
    if not isinstance(targets, str):
        adapted = {".".join(n.split(".")[2:-2]) for n in header}
        for t in targets:
            if not any(_targeted(m, [t]) for m in modules):
                raise InputError(
                    f"{where}: target_modules names '{t[:60]}', which the base has no module of: the adapter "
                    f"was made for another model, or remove it from {ADAPTER_CONFIG}"
                )
            if not any(_targeted(m, [t]) for m in adapted):
                raise InputError(
                    f"{where}: target_modules names '{t[:60]}' but {ADAPTER_FILE} holds no tensor for it: restore "
                    "the adapter"
                )
    return c
