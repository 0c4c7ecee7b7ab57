"""Checkpoint <-> Hugging Face LlamaForCausalLM (safetensors + config.json), and a single-file torch export.

Names: Meta's (ours) <-> HF's, one table. RoPE layout: our attention rotates *interleaved* pairs
(dims 2i, 2i+1) while HF rotates *halves* (dims i, i + d/2), so the rows of wq and wk are permuted within
each head on export (row 2i+k -> row k*d/2 + i) and back on import. Everything is read and written
without pickle: DCP shards hold raw tensors, safetensors is a flat tensor format.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

from dtlaunch.errors import InputError

# Ours -> HF, per transformer block; the '{}' is the block index.
_BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TORCH_FILE = "model.pt"


def to_hf_name(name: str) -> str:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
    raise KeyError(f"no Hugging Face name for parameter '{name}'")


def from_hf_name(name: str) -> str:
    for ours, theirs in _TOP_NAMES.items():
        if name == theirs:
            return ours
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m:
        for ours, theirs in _BLOCK_NAMES.items():
            if m.group(2) == theirs:
                return f"layers.{m.group(1)}.{ours}"
    raise KeyError(f"unknown Hugging Face Llama tensor '{name}'")


def interleaved_to_halves(w: Any, n_heads: int) -> Any:
    """Rows of a q/k projection, per head: ours (pairs 2i, 2i+1) -> HF (i, i + d/2)."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def halves_to_interleaved(w: Any, n_heads: int) -> Any:
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _heads_for(name: str, m: Any) -> Optional[int]:
    from dtlaunch.models.shapes import kv_heads

    if name.endswith("attention.wq.weight"):
        return int(m.n_heads)
    if name.endswith("attention.wk.weight"):
        return kv_heads(m)
    return None


def to_hf_state(state: dict, m: Any) -> dict:
    """Our parameter dict -> HF's names and RoPE layout (contiguous tensors, ready for safetensors)."""
    out = {}
    for name, t in state.items():
        heads = _heads_for(name, m)
        t = interleaved_to_halves(t, heads) if heads else t
        out[to_hf_name(name)] = t.contiguous()
    return out


def from_hf_state(state: dict, m: Any) -> dict:
    out = {}
    for hf_name, t in state.items():
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue  # derived from the config; some exports carry it
        name = from_hf_name(hf_name)
        heads = _heads_for(name, m)
        out[name] = (halves_to_interleaved(t, heads) if heads else t).contiguous()
    return out


def hf_config(m: Any, dtype: str = "float32") -> dict:
    """config.json for transformers' LlamaConfig."""
    from dtlaunch.models.shapes import ffn_dim, head_dim, kv_heads

    rs = m.rope_scaling
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": int(m.dim),
        "intermediate_size": ffn_dim(m),
        "num_hidden_layers": int(m.n_layers),
        "num_attention_heads": int(m.n_heads),
        "num_key_value_heads": kv_heads(m),
        "head_dim": head_dim(m),
        "vocab_size": int(m.vocab_size),
        "rms_norm_eps": float(m.norm_eps),
        "rope_theta": float(m.rope_theta),
        "rope_scaling": None
        if rs is None
        else {
            "rope_type": "llama3",
            "factor": float(rs.factor),
            "low_freq_factor": float(rs.low_freq_factor),
            "high_freq_factor": float(rs.high_freq_factor),
            "original_max_position_embeddings": int(rs.original_max_seq_len),
        },
        "max_position_embeddings": int(m.max_seq_len),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }


# ---------------------------------------------------------------------------------------------
# Reading a DCP checkpoint on one process.


def model_config_from_marker(marker: dict) -> Any:
    """The typed model section a checkpoint was written with (stored in its completion marker)."""
    from omegaconf import OmegaConf

    from dtlaunch.config.schema import ModelConfig

    if "model" not in marker:
        raise InputError("checkpoint marker has no model section: it was not written by dtlaunch's CheckpointManager")
    return OmegaConf.merge(OmegaConf.structured(ModelConfig), marker["model"])


def load_checkpoint_model(path: Path) -> tuple[dict, Any, Any]:
    """(parameter dict of full tensors, model config, CheckpointInfo) from a checkpoint, a run directory
    or its checkpoints directory - read on this one process, no process group, whatever layout wrote it."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from dtlaunch.train.checkpoint import _SafeLoadPlanner, resolve_load_path

    info, _ = resolve_load_path(Path(path))
    meta = dcp.FileSystemReader(str(info.path)).read_metadata()
    state: dict[str, Any] = {}
    for key, md in meta.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata):
            state[key[len("model.") :]] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    if not state:
        raise InputError(f"checkpoint '{info.path}' holds no model tensors")
    box = {"model": state}
    dcp.load(box, checkpoint_id=str(info.path), planner=_SafeLoadPlanner(), no_dist=True)
    return box["model"], model_config_from_marker(info.marker), info


# ---------------------------------------------------------------------------------------------
# Export.


def save_hf(state: dict, m: Any, out: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[Path]:
    """Write config.json and model.safetensors, or numbered shards + an index when larger than the limit."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    hf = to_hf_state(state, m)
    dtypes = {str(t.dtype).replace("torch.", "") for t in hf.values()}
    (out / "config.json").write_text(json.dumps(hf_config(m, dtype=sorted(dtypes)[0]), indent=2) + "\n")
    shards: list[dict] = [{}]
    size = 0
    for name in sorted(hf, key=_hf_order):
        nbytes = hf[name].numel() * hf[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = hf[name]
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE_FILE), metadata=meta)
        return [out / SINGLE_FILE]
    files, weight_map = [], {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata=meta)
        files.append(out / fname)
        weight_map.update({n: fname for n in shard})
    total = sum(t.numel() * t.element_size() for t in hf.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return files


def _hf_order(name: str) -> tuple:
    m = re.search(r"layers\.(\d+)\.", name)
    return (0 if "embed" in name else 2 if m is None else 1, int(m.group(1)) if m else 0, name)


def save_torch(state: dict, m: Any, out: Path) -> Path:
    """One consolidated file of our own names: a plain {name: tensor} dict (load with weights_only=True)."""
    import torch

    from dtlaunch.config.schema import to_dict

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.contiguous() for k, v in state.items()}, out / TORCH_FILE)
    (out / "model_config.json").write_text(json.dumps(to_dict(m), indent=2) + "\n")
    return out / TORCH_FILE


def export_checkpoint(src: Path, fmt: str, out: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[Path]:
    if fmt not in ("hf", "torch"):
        raise InputError(f"--format {fmt!r} is not an export format: use hf or torch")
    state, m, info = load_checkpoint_model(src)
    if fmt == "hf":
        return save_hf(state, m, out, max_shard_bytes) + export_tokenizer(Path(info.path), out)
    return [save_torch(state, m, out)]


def export_tokenizer(checkpoint: Path, out: Path) -> list[Path]:
    """The run's Hugging Face tokenizer (kept in <run dir>/tokenizer by the launcher), beside the weights.
    Runs on the byte tokenizer or synthetic data have none: nothing is written."""
    from dtlaunch.data.tokenizer import RUN_TOKENIZER_DIR, copy_tokenizer_files

    for parent in list(checkpoint.resolve().parents)[:3]:  # run/checkpoints/step-N
        kept = parent / RUN_TOKENIZER_DIR / "tokenizer.json"
        if kept.is_file():
            return copy_tokenizer_files(kept, Path(out))
    return []


# ---------------------------------------------------------------------------------------------
# Import (model.init_from=hf:DIR).


def read_safetensors_dir(path: Path) -> dict:
    from safetensors.torch import load_file

    path = Path(path)
    if (path / INDEX_FILE).is_file():
        files = sorted(set(json.loads((path / INDEX_FILE).read_text())["weight_map"].values()))
    elif (path / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        raise InputError(
            f"model.init_from: '{path}' has no {SINGLE_FILE} or {INDEX_FILE}: point it at a Hugging Face "
            f"model directory (e.g. from `dtlaunch ckpt export --format hf`)"
        )
    state: dict = {}
    for f in files:
        state.update(load_file(str(path / f)))
    return state


def load_hf_weights(path: str | Path, m: Any) -> dict:
    """{our parameter name: full fp32 tensor} from a HF Llama directory, checked against the model config."""
    from dtlaunch.models.llama import build_model

    path = Path(path)
    state = from_hf_state(read_safetensors_dir(path), m)
    expected = {n: tuple(p.shape) for n, p in build_model(m, rope_len=1, device="meta").named_parameters()}
    missing = sorted(set(expected) - set(state))
    if missing:
        raise InputError(
            f"model.init_from=hf:{path}: tensor {to_hf_name(missing[0])} is missing "
            f"({len(missing)} missing): the directory does not hold this model"
        )
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise InputError(
                f"model.init_from=hf:{path}: {to_hf_name(name)} has shape {tuple(state[name].shape)}, the model "
                f"config needs {shape}: set the model config to match the checkpoint (see its config.json)"
            )
    extra = sorted(set(state) - set(expected))
    if extra:
        raise InputError(f"model.init_from=hf:{path}: unexpected tensor {to_hf_name(extra[0])} for this model config")
    return {n: state[n].float() for n in expected}


def hf_init_dir(m: Any) -> Optional[str]:
    """The directory of `model.init_from=hf:DIR`, None for random init."""
    src = str(getattr(m, "init_from", "random") or "random")
    if src == "random":
        return None
    if not src.startswith("hf:") or not src[3:]:
        raise InputError(f"model.init_from='{src}' is not a weight source: use random or hf:DIR")
    return src[3:]


_CACHE: dict[tuple[str, str], dict] = {}


def cached_hf_weights(m: Any) -> Optional[dict]:
    """load_hf_weights once per process (pipeline stages on one rank share it); None for random init."""
    path = hf_init_dir(m)
    if path is None:
        return None
    from dtlaunch.config.schema import to_dict

    key = (path, json.dumps(to_dict(m), sort_keys=True))
    if key not in _CACHE:
        _CACHE.clear()
        _CACHE[key] = load_hf_weights(path, m)
        from dtlaunch.train.phases import phase

        # Once per process, on rank 0: which weights the run starts from, so a wrong DIR shows at once.
        n = sum(t.numel() for t in _CACHE[key].values())
        phase(f"model.init_from: loaded {len(_CACHE[key])} tensors ({n:,} parameters) from {path}")
    return _CACHE[key]
