"""LoRA adapters <-> Hugging Face peft's format, and merged weights, from a checkpoint of any layout.

A LoRA run's checkpoint holds the adapters (`<linear>.lora_a` [rank, in], `<linear>.lora_b` [out, rank])
and, in its completion marker, the peft section and the base's path and fingerprint
(dtlaunch.convert.base_fingerprint). Reading it needs no process group: DCP reassembles the full adapter
tensors on one process whatever layout wrote them, and the base is read from its safetensors.

- PEFT export: `adapter_model.safetensors` (keys `base_model.model.<HF module>.lora_A.weight` / `lora_B`)
  + `adapter_config.json`, for `peft.PeftModel.from_pretrained(<the base's transformers model>, DIR)`.
  A reward model's (objective=reward) `score` head trains in full beside the adapters: it is written as
  peft writes a module of `modules_to_save` (`base_model.model.score.weight`, task_type SEQ_CLS), for
  the base loaded as AutoModelForSequenceClassification with num_labels=1.
  Names come from the family's HF mapping; lora_B of q/k is permuted into HF's RoPE layout exactly as
  the base weight's rows are (lora_A acts on the input and is not).
- Merged export: W + (alpha / rank) B A for every adapted linear, written as a plain HF model (a reward
  model's: the *ForSequenceClassification with its score head, as a full reward run's export).
- The reverse (`generate hf:DIR --adapter ADIR`): a peft adapter directory read into our names, merged.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from dtlaunch.config.weight_source import WeightSource, hf_name
from dtlaunch.errors import InputError
from dtlaunch.inputs.adapter_dir import ADAPTER_CONFIG, ADAPTER_FILE, PEFT_PREFIX, check_adapter_dir
from dtlaunch.inputs.hf_dir import read_weight_headers
from dtlaunch.models.dtypes import torch_dtype
from dtlaunch.models.score_head import SCORE_HEAD, SCORE_MODULE

_PEFT_KEY = {"lora_a": "lora_A", "lora_b": "lora_B"}


@dataclass
class Adapters:
    """Adapters in our names and layout, with what merging needs."""

    tensors: dict  # "<linear fqn>.lora_a" / ".lora_b" -> full fp32 tensor
    scaling: float
    record: dict  # the peft record (method, rank, alpha, dropout, targets, base, base_fingerprint)
    m: Any  # the model section
    # Tensors trained in full beside the adapters, our names (a reward model's score head): peft's modules_to_save.
    full: dict = field(default_factory=dict)
    # The routed experts' adapters (peft.target_experts): "<experts fqn>.lora_gate_up_a" ... -> full fp32 tensor.
    experts: dict = field(default_factory=dict)

    def expert_stacks(self) -> list[str]:
        return sorted({k.rsplit(".", 1)[0] for k in self.experts})

    def expert_tensors(self, fqn: str) -> dict:
        """One experts module's four adapter stacks by leaf name (lora_gate_up_a, ..., lora_down_b)."""
        from dtlaunch.models.lora import EXPERT_ADAPTER_NAMES

        return {leaf: self.experts[f"{fqn}.{leaf}"] for leaf in EXPERT_ADAPTER_NAMES}

    def linears(self) -> list[str]:
        return sorted({k.rsplit(".", 1)[0] for k in self.tensors})


def _spec(m: Any) -> Any:
    from dtlaunch.models.registry import model_spec

    return model_spec(m)


def _meta_model(m: Any) -> Any:
    from dtlaunch.models.registry import meta_model

    return meta_model(m)


def base_dir(record: dict, where: str) -> Path:
    """The directory of the base the adapters were trained on; refused when it is gone or has changed."""
    from dtlaunch.convert.base_fingerprint import fingerprint

    base = str(record.get("base", ""))
    if not WeightSource.parse(base).is_hf:
        raise InputError(
            f"{where}: the adapters were trained on a randomly initialised base (model.init_from={base}), which no "
            "model directory holds: fine-tune from model.init_from=hf:DIR to export or generate"
        )
    from dtlaunch.hub.model_source import hf_weights_dir

    path = Path(str(hf_weights_dir(base)))  # a hub name: its pinned snapshot, fetched into the cache if gone
    if not path.is_dir():
        raise InputError(f"{where}: its base {path} does not exist any more: restore it there")
    now = fingerprint(path)
    if now != record.get("base_fingerprint"):
        raise InputError(
            f"{where}: its base {path} has changed since training ({record.get('base_fingerprint')} -> {now}): "
            "restore the base the adapters were trained on"
        )
    return path


def load_run_adapters(src: Path) -> tuple[Adapters, Any]:
    """The adapters of a LoRA run (a run directory, its checkpoints directory or one checkpoint) and its
    CheckpointInfo. A checkpoint of a full training run is refused."""
    from dtlaunch.convert.hf import load_checkpoint_model

    state, m, info = load_checkpoint_model(Path(src))
    record = info.marker.get("peft")
    if not record:
        raise InputError(
            f"checkpoint '{info.path}' holds no adapters (a full training run): export it with --format hf or torch"
        )
    from dtlaunch.models.lora import EXPERT_ADAPTER_NAMES

    tensors = {k: v for k, v in state.items() if k.rsplit(".", 1)[-1] in _PEFT_KEY}
    full = {k: v for k, v in state.items() if k == SCORE_HEAD}
    experts = {k: v for k, v in state.items() if k.rsplit(".", 1)[-1] in EXPERT_ADAPTER_NAMES}
    scaling = float(record["alpha"]) / int(record["rank"])
    return Adapters(tensors, scaling, dict(record), m, full, experts), info


# ---------------------------------------------------------------------------------------------
# Our names <-> peft's.


def to_peft_state(adapters: Adapters) -> dict:
    names = _spec(adapters.m).names()
    out = {}
    for key, t in adapters.tensors.items():
        fqn, leaf = key.rsplit(".", 1)
        if leaf == "lora_b":  # output rows: the base weight's HF layout (RoPE permutation of q/k)
            ((hf_weight, t),) = names.to_hf_state({f"{fqn}.weight": t}, adapters.m).items()
        else:
            hf_weight = names.to_hf_name(f"{fqn}.weight")
        out[f"{PEFT_PREFIX}{hf_weight.rsplit('.', 1)[0]}.{_PEFT_KEY[leaf]}.weight"] = t.contiguous()
    for key, t in adapters.full.items():  # the score head: transformers' own name, as peft saves modules_to_save
        out[f"{PEFT_PREFIX}{key}"] = t.contiguous()
    out.update(_experts_to_peft(adapters, names))
    return out


# peft.target_experts: PEFT's `target_parameters` on transformers' fused expert tensors. PEFT nests one
# wrapper per targeted parameter, the first listed innermost (its adapter under `base_layer`).
EXPERT_TARGETS = ("gate_up_proj", "down_proj")


def _experts_module(names: Any, fqn: str) -> str:
    """The transformers module path holding the fused expert tensors of our experts module `fqn`."""
    hf = names.to_hf_name(f"{fqn}.w1")
    return hf[: hf.index(".experts") + len(".experts")]


def _experts_to_peft(adapters: Adapters, names: Any) -> dict:
    """Our [E, r, in] / [E, out, r] stacks as PEFT's lora_A [r * E, in] / lora_B [out, r * E] (expert e's
    rank-r slice at columns r_i * E + e of B, rows e * r + r_i of A: peft's ParamWrapper reshapes), gate_up's
    B rows in transformers' order of the fused tensor (gate rows, then up rows; gpt-oss interleaves them)."""
    import torch

    out = {}
    interleaved = bool(getattr(names, "GATE_UP_INTERLEAVED", False))
    for fqn in adapters.expert_stacks():
        module = f"{PEFT_PREFIX}{_experts_module(names, fqn)}"
        t = adapters.expert_tensors(fqn)
        gate_up_b = t["lora_gate_up_b"]
        if interleaved:
            gate, up = gate_up_b.chunk(2, dim=1)
            gate_up_b = torch.stack([gate, up], dim=2).flatten(1, 2)
        for where, a, b in (
            (f"{module}.base_layer", t["lora_gate_up_a"], gate_up_b),
            (module, t["lora_down_a"], t["lora_down_b"]),
        ):
            e, r, inp = a.shape
            out[f"{where}.lora_A.weight"] = a.reshape(e * r, inp).contiguous()
            out[f"{where}.lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], r * e).contiguous()
    return out


def from_peft_state(state: dict, m: Any, where: str) -> dict:
    names = _spec(m).names()
    out = {}
    for key, t in state.items():
        parts = key.split(".")
        if not key.startswith(PEFT_PREFIX) or len(parts) < 3 or parts[-2] not in ("lora_A", "lora_B"):
            raise InputError(f"{where}: tensor {key} is not a LoRA adapter weight (peft's lora_A / lora_B)")
        hf_module = ".".join(parts[len(PEFT_PREFIX.split(".")) - 1 : -2])
        hf_weight = f"{hf_module}.weight"
        try:
            if parts[-2] == "lora_B":
                ((ours, t),) = names.from_hf_state({hf_weight: t}, m).items()
            else:
                ours = names.from_hf_name(hf_weight)
        except InputError:
            raise InputError(f"{where}: the adapter is for module {hf_module}, which this base model has not") from None
        out[f"{ours.rsplit('.', 1)[0]}.{'lora_a' if parts[-2] == 'lora_A' else 'lora_b'}"] = t.float()
    return out


def peft_config(adapters: Adapters) -> dict:
    """adapter_config.json: the keys peft reads (LoraConfig), for a causal LM (a reward model: sequence
    classification, its score head in modules_to_save)."""
    from dtlaunch.models.lora import expert_names, hf_module_name

    spec = _spec(adapters.m)
    targets = sorted({hf_module_name(spec, fqn).rsplit(".", 1)[-1] for fqn in adapters.linears()})
    shared = sorted(set(targets) & expert_names(_meta_model(adapters.m), spec))
    if shared:
        # transformers fuses a MoE model's experts, and peft adapts every module of a target's name, experts too.
        raise InputError(
            f"--format peft: the adapters on the dense MLP ({', '.join(shared)}) share their names with the routed "
            "experts, which peft would adapt as well: use --format hf (merged), or train with "
            "peft.targets=[q_proj,k_proj,v_proj,o_proj]"
        )
    rec = adapters.record
    reward = SCORE_HEAD in adapters.full
    return {
        "peft_type": "LORA",
        "task_type": "SEQ_CLS" if reward else "CAUSAL_LM",
        "base_model_name_or_path": hf_name(rec.get("base")) or None,
        "r": int(rec["rank"]),
        "lora_alpha": float(rec["alpha"]),
        "lora_dropout": float(rec["dropout"]),
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": [SCORE_MODULE] if reward else None,
        # PEFT's names of the fused expert tensors, relative to a block (peft.target_experts).
        "target_parameters": [f"mlp.experts.{p}" for p in EXPERT_TARGETS] if adapters.experts else None,
    }


def save_peft(adapters: Adapters, out: Path) -> list[Path]:
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # The base's fingerprint rides in the safetensors metadata (peft ignores it): `generate --adapter`
    # refuses a different base with it.
    meta = {"format": "pt", "dtlaunch_base_fingerprint": str(adapters.record.get("base_fingerprint") or "")}
    save_file(to_peft_state(adapters), str(out / ADAPTER_FILE), metadata=meta)
    (out / ADAPTER_CONFIG).write_text(json.dumps(peft_config(adapters), indent=2) + "\n")
    return [out / ADAPTER_FILE, out / ADAPTER_CONFIG]


def load_peft_dir(path: Path, m: Any, base: Path) -> Adapters:
    """A peft LoRA adapter directory, for the model `m` read from `base`: names, shapes and (when the
    adapter was written by dtlaunch) the base's fingerprint are checked."""
    from safetensors import safe_open

    from dtlaunch.convert.base_fingerprint import fingerprint

    where = f"--adapter {path}"
    file = path / ADAPTER_FILE
    # Config against the tensors' shapes and the base's modules, from headers only (peft refuses these too).
    c = check_adapter_dir(path, read_weight_headers(base))
    with safe_open(str(file), framework="pt") as fh:
        saved_fp = (fh.metadata() or {}).get("dtlaunch_base_fingerprint", "")
        state = {k: fh.get_tensor(k) for k in fh.keys()}
    if saved_fp and saved_fp != fingerprint(base):
        raise InputError(
            f"{where}: the adapter was trained on another base than hf:{base} (fingerprint {saved_fp}): give the "
            "base it was trained on"
        )
    tensors = from_peft_state(state, m, where)
    r, alpha = int(c["r"]), float(c["lora_alpha"])
    scaling = alpha / math.sqrt(r) if c.get("use_rslora") else alpha / r
    record = {"method": "lora", "rank": r, "alpha": alpha, "dropout": float(c.get("lora_dropout") or 0.0)}
    return Adapters(tensors, scaling, record, m)


# ---------------------------------------------------------------------------------------------
# Merging.


def merge(base: dict, adapters: Adapters, where: str) -> dict:
    """base + scaling * B A for every adapted linear (in the base's dtype); shapes checked."""
    out = dict(base)
    for fqn in adapters.linears():
        key = f"{fqn}.weight"
        a, b = adapters.tensors.get(f"{fqn}.lora_a"), adapters.tensors.get(f"{fqn}.lora_b")
        if key not in base or a is None or b is None:
            raise InputError(f"{where}: adapter {fqn} has no matching linear (or lacks lora_a / lora_b) in the base")
        w = base[key]
        if a.dim() != 2 or b.dim() != 2 or (b.shape[0], a.shape[1]) != tuple(w.shape) or a.shape[0] != b.shape[1]:
            raise InputError(
                f"{where}: adapter {fqn} has shapes A {tuple(a.shape)}, B {tuple(b.shape)}, the base's weight is "
                f"{tuple(w.shape)}: the adapter belongs to another base model"
            )
        out[key] = (w.float() + adapters.scaling * (b.float() @ a.float())).to(w.dtype)
    for fqn in adapters.expert_stacks():  # the routed experts' stacks, as GroupedExperts.local_weights merges
        t = {leaf: v.float() for leaf, v in adapters.expert_tensors(fqn).items()}
        w1, w2, w3 = (base.get(f"{fqn}.{w}") for w in ("w1", "w2", "w3"))
        if w1 is None or w2 is None or w3 is None:
            raise InputError(f"{where}: adapter {fqn} has no matching routed experts in the base")
        gate_up = adapters.scaling * (t["lora_gate_up_b"] @ t["lora_gate_up_a"])
        down = adapters.scaling * (t["lora_down_b"] @ t["lora_down_a"])
        if gate_up.shape != (w1.shape[0], 2 * w1.shape[1], w1.shape[2]) or down.shape != tuple(w2.shape):
            raise InputError(
                f"{where}: adapter {fqn} does not fit the base's experts: the adapter belongs to another base"
            )
        f = w1.shape[1]
        out[f"{fqn}.w1"] = (w1.float() + gate_up[:, :f]).to(w1.dtype)
        out[f"{fqn}.w3"] = (w3.float() + gate_up[:, f:]).to(w3.dtype)
        out[f"{fqn}.w2"] = (w2.float() + down).to(w2.dtype)
    return out


def merged_run_state(src: Path) -> tuple[dict, Any, Any]:
    """(merged parameter dict in our names, model section, CheckpointInfo) of a LoRA run."""
    from dtlaunch.convert.hf import load_hf_weights

    adapters, info = load_run_adapters(src)
    where = f"checkpoint '{info.path}'"
    base = load_hf_weights(base_dir(adapters.record, where), adapters.m)
    merged = merge(_dequantized(base, adapters), adapters, where)
    if adapters.full:  # a reward model: the trained score head in place of the base's LM head
        merged = {k: v for k, v in merged.items() if k not in ("output.weight", "output.bias")} | adapters.full
    return merged, adapters.m, info


def _dequantized(base: dict, adapters: Adapters) -> dict:
    """QLoRA trained against the NF4-rounded base: the merge starts from the same rounding of every block
    linear (quantised to NF4 from the training dtype, as the run did, and dequantised)."""
    rec = adapters.record
    if rec.get("method") != "qlora":
        return base
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    from dtlaunch.models.lora import candidate_linears

    dtype = torch_dtype(rec.get("base_dtype", "bf16"))
    spec = _spec(adapters.m)
    out = dict(base)
    for fqn in candidate_linears(_meta_model(adapters.m), spec):
        w = base[f"{fqn}.weight"]
        q = to_nf4(w.to(dtype).contiguous(), int(rec["nf4_block_size"]), int(rec["nf4_scaler_block_size"]))
        out[f"{fqn}.weight"] = q.get_original_weight().to(w.dtype)
    return out


def export_adapters(src: Path, fmt: str, out: Path, max_shard_bytes: int) -> Optional[list[Path]]:
    """`ckpt export`: peft (the adapters) or hf (the merged model) for a LoRA run; None when `src` holds
    no adapters and `fmt` is not peft (the caller exports the full model)."""
    from dtlaunch.convert.hf import export_tokenizer, padding_token, save_hf
    from dtlaunch.run.checkpoints import resolve_load_path

    info, _ = resolve_load_path(Path(src))
    if fmt != "peft" and not info.marker.get("peft"):
        return None
    if fmt == "peft":
        adapters, info = load_run_adapters(src)
        return save_peft(adapters, out)
    if fmt == "torch":
        raise InputError(
            f"--format torch: checkpoint '{info.path}' holds adapters, not a full model: use --format peft "
            "(the adapters) or --format hf (the base with the adapters merged)"
        )
    state, m, info = merged_run_state(src)
    # A reward model: its config.json names the token its rows were padded with (as a full run's export).
    pad = padding_token(Path(info.path)) if SCORE_HEAD in state else None
    return save_hf(state, m, out, max_shard_bytes, pad_token_id=pad) + export_tokenizer(Path(info.path), out)
