"""Checkpoint <-> Hugging Face directory (safetensors + config.json), and a single-file torch export.

Everything model-specific (tensor names, RoPE layout, config.json vocabulary) comes from the model's
registry entry (`spec.names()`, `spec.hf`); this module moves tensors. Everything is read and written
without pickle: DCP shards hold raw tensors, safetensors is a flat tensor format.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from dtlaunch.config.weight_source import WeightSource
from dtlaunch.errors import InputError
from dtlaunch.inputs.hf_dir import INDEX_FILE, SINGLE_FILE, read_weight_headers, weight_files
from dtlaunch.job.model_schema import model_config_from_marker
from dtlaunch.models.dense.hf import halves_to_interleaved
from dtlaunch.models.score_head import SCORE_HEAD

if TYPE_CHECKING:
    from dtlaunch.config.schema import ModelConfig

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
TORCH_FILE = "model.pt"


def _spec(m: Any) -> Any:
    from dtlaunch.models.registry import model_spec

    return model_spec(m)


def to_hf_state(state: dict, m: Any) -> dict:
    """Our parameter dict -> HF's names and layout (the model's registry entry decides both)."""
    if not _spec(m).hf_names:  # model.arch=hf_auto: the names are transformers' own already
        return {k: v.contiguous() for k, v in state.items()}
    return _spec(m).names().to_hf_state(state, m)


def from_hf_state(state: dict, m: Any) -> dict:
    return _spec(m).names().from_hf_state(state, m)


def hf_config(m: ModelConfig, dtype: str = "float32") -> dict:
    """config.json for the model's Hugging Face architecture."""
    if _spec(m).hf is None:  # model.arch=hf_auto: the source directory's own config.json
        from dtlaunch.hub.model_source import hf_source_dir, read_hf_config

        src = hf_source_dir(m.init_from)
        if src is None:
            raise InputError("this checkpoint's model has no Hugging Face config to export")
        return {**read_hf_config(src), "torch_dtype": dtype}
    return _spec(m).hf.config_to_hf(m, dtype)


# ---------------------------------------------------------------------------------------------
# Reading a DCP checkpoint on one process.


def load_checkpoint_model(path: Path) -> tuple[dict, Any, Any]:
    """(parameter dict of full tensors, model config, CheckpointInfo) from a checkpoint, a run directory
    or its checkpoints directory - read on this one process, no process group, whatever layout wrote it."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from dtlaunch.convert.dcp_planner import safe_load_planner
    from dtlaunch.run.checkpoints import resolve_load_path

    info, _ = resolve_load_path(Path(path))
    meta = dcp.FileSystemReader(str(info.path)).read_metadata()
    state: dict[str, Any] = {}
    for key, md in meta.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata):
            state[key[len("model.") :]] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    if not state:
        raise InputError(f"checkpoint '{info.path}' holds no model tensors")
    m = model_config_from_marker(info.marker)
    _check_marker_shapes(state, m, info.path)
    box = {"model": state}
    with warnings.catch_warnings():
        # DCP warns that it reads "in a single process": that is what no_dist=True asks for, not news to the user.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(box, checkpoint_id=str(info.path), planner=safe_load_planner(), no_dist=True)
    return box["model"], m, info


def _check_marker_shapes(state: dict, m: Any, path: Any) -> None:
    """The model the marker describes has the checkpoint's tensor shapes (a spoiled marker would load
    into another model, or fail deep inside torch)."""
    where = f"checkpoint '{path}': its marker's model section (COMPLETE.json)"
    try:
        built = _spec(m).build(m, rope_len=1, device="meta")
    except Exception as exc:  # noqa: BLE001 - any failure to build from a spoiled description is the file's
        raise InputError(f"{where} describes no buildable model ({type(exc).__name__}): restore the marker") from None
    for name, p in built.named_parameters():
        if name in state and tuple(state[name].shape) != tuple(p.shape):
            raise InputError(
                f"{where} needs {name} of shape {tuple(p.shape)}, the checkpoint holds {tuple(state[name].shape)}: "
                "restore the marker"
            )


# ---------------------------------------------------------------------------------------------
# Export.


def save_hf(
    state: dict, m: Any, out: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, pad_token_id: Optional[int] = None
) -> list[Path]:
    """Write config.json and model.safetensors, or numbered shards + an index when larger than the limit.
    A reward model (its `score` head, no LM head) is written as the family's *ForSequenceClassification with
    one label; `pad_token_id`: the token its rows were padded with (transformers reads each row's reward at
    the last other token)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    score = state.get(SCORE_HEAD)
    hf = to_hf_state({k: v for k, v in state.items() if k != SCORE_HEAD}, m)
    dtypes = {str(t.dtype).replace("torch.", "") for t in hf.values()}
    config = hf_config(m, dtype=sorted(dtypes)[0])
    if score is not None:
        hf[SCORE_HEAD] = score.contiguous()
        archs = [a.replace("ForCausalLM", "ForSequenceClassification") for a in config["architectures"]]
        config = {**config, "architectures": archs, "num_labels": 1, "pad_token_id": pad_token_id}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
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


def export_tokenizer(checkpoint: Path, out: Path) -> list[Path]:
    """The run's tokenizer beside the weights: its Hugging Face tokenizer (kept in <run dir>/tokenizer by the
    launcher), or the byte tokenizer's Hugging Face form for a run that trained on text with it. Runs on
    synthetic data without a model tokenizer have none (their ids are not text): nothing is written."""
    from dtlaunch.data.tokenizer import copy_tokenizer_files
    from dtlaunch.run.run_dir import RunDir

    run = RunDir.of_checkpoint(checkpoint.resolve())
    if run is not None and run.tokenizer.is_file():
        return copy_tokenizer_files(run.tokenizer, Path(out))
    if run is not None and run.config.is_file() and _trained_on_bytes(run.config):
        from dtlaunch.data.byte_hf_tokenizer import write_byte_tokenizer

        return write_byte_tokenizer(Path(out))
    return []


def padding_token(checkpoint: Path) -> Optional[int]:
    """The token a run's preference rows were padded with: its tokenizer's EOS (dtlaunch.data.preference),
    as the data pipeline finds it; None for a run on synthetic ids (never padded)."""
    from dtlaunch.data.tokenizer import BYTE_EOS, HFTokenizer
    from dtlaunch.run.run_dir import RunDir

    run = RunDir.of_checkpoint(checkpoint.resolve())
    if run is not None and run.tokenizer.is_file():
        return HFTokenizer(run.tokenizer).eos_id
    if run is not None and run.config.is_file() and _trained_on_bytes(run.config):
        return BYTE_EOS
    return None


def _trained_on_bytes(config_yaml: Path) -> bool:
    """The run's ids are the byte tokenizer's: data.tokenizer resolves to byte and the data is text."""
    from dtlaunch.job.compose import load_resolved
    from dtlaunch.job.tokenizer_choice import effective_tokenizer

    cfg = load_resolved(config_yaml)
    return effective_tokenizer(cfg) == "byte" and str(cfg.data.kind) != "synthetic"


# ---------------------------------------------------------------------------------------------
# Import (model.init_from=hf:DIR): headers checked up front, then each rank reads only its slices.


class HFWeights:
    """A Hugging Face directory opened for reading parameters one at a time.

    Construction reads only the safetensors headers (names, shapes) and checks them against the
    model: a missing, extra or wrongly shaped tensor is an InputError naming it. `read(name, shape,
    offset)` then returns one parameter's slice in our layout, read with safe_open's `get_slice`: a
    rank holding a shard (FSDP / TP) reads its rows, never the whole tensor, and never the whole
    model. Tensors whose rows the RoPE layout permutes within each head are read over the whole heads
    the slice touches, permuted, and cut down.
    """

    def __init__(self, path: str | Path, m: Any) -> None:
        path = Path(path)
        self.path, self.m, self.spec = path, m, _spec(m)
        self.names = self.spec.names()
        read_weight_headers(path)  # a spoiled file or index: one line naming it (safe_open's error names none)
        self.files = weight_files(path)
        if not self.files:
            raise InputError(
                f"model.init_from: '{path}' has no {SINGLE_FILE} or {INDEX_FILE}: point it at a Hugging Face "
                f"model directory (e.g. from `dtlaunch ckpt export --format hf`)"
            )
        self.where: dict[str, tuple[str, str]] = {}  # our name -> (file, HF name)
        # Our 3-D expert tensors, stored by HF as one tensor per expert: name -> {expert: (file, HF name)}.
        self.stacked: dict[str, dict[int, tuple[str, str]]] = {}
        # Ours held inside one fused HF tensor (gpt-oss's experts): name -> (HF name, HF -> ours, the other
        # HF tensors that function reads (MXFP4 scales)).
        self.parts: dict[str, tuple[str, Any, tuple[str, ...]]] = {}
        self.hf_files: dict[str, str] = {}  # HF name -> its file
        hf_shapes: dict[str, tuple[int, ...]] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        import torch
        from safetensors import safe_open

        tied = bool(getattr(m, "tie_embeddings", False))
        expert_slot = getattr(self.names, "expert_slot", None)
        # Tensors a family's directory carries that its model has not (GLM-4.5's multi-token-prediction layer).
        skip = getattr(self.names, "skip_hf", None)
        hf_parts = getattr(self.names, "hf_parts", None)
        companions = getattr(self.names, "hf_companions", lambda name: ())
        for f in self.files:
            with safe_open(str(path / f), framework="pt") as fh:
                for hf_name in fh.keys():
                    if hf_name.endswith("rotary_emb.inv_freq") or (tied and hf_name == "lm_head.weight"):
                        continue
                    if skip and skip(hf_name, m):
                        continue
                    shape = tuple(fh.get_slice(hf_name).get_shape())
                    self.hf_files[hf_name], hf_shapes[hf_name] = f, shape
                    parts = hf_parts(hf_name) if hf_parts else None
                    if parts is not None:
                        for ours, take in parts.items():
                            self.parts[ours] = (hf_name, take, companions(hf_name))
                        continue
                    try:
                        slot = expert_slot(hf_name) if expert_slot else None
                        ours = slot[0] if slot else self.names.from_hf_name(hf_name)
                    except InputError as exc:
                        raise InputError(f"model.init_from=hf:{path}: {exc}") from None
                    if slot:
                        self.stacked.setdefault(ours, {})[slot[1]] = (f, hf_name)
                        shapes[ours] = (len(self.stacked[ours]), *shape)
                        continue
                    self.where[ours] = (f, hf_name)
                    shapes[ours] = shape
        for ours, (hf_name, take, others) in self.parts.items():
            lost = [c for c in others if c not in hf_shapes]
            if lost:
                raise InputError(
                    f"model.init_from=hf:{path}: tensor {lost[0]} is missing (read with {hf_name}): the directory "
                    f"does not hold this model"
                )
            shapes[ours] = tuple(take(*(torch.empty(hf_shapes[n], device="meta") for n in (hf_name, *others))).shape)
        for ours, per in self.stacked.items():
            if sorted(per) != list(range(len(per))):
                missing_e = min(set(range(max(per) + 1)) - set(per))
                raise InputError(
                    f"model.init_from=hf:{path}: expert {missing_e} of {self.names.to_hf_name(ours)} is missing: "
                    f"the directory does not hold this model"
                )
        meta = self.spec.build(m, rope_len=1, device="meta")
        expected = {n: tuple(p.shape) for n, p in meta.named_parameters()}
        # Persistent buffers the directory holds (names.hf_buffers: GLM-4.5's router correction bias).
        loaded = tuple(getattr(self.names, "hf_buffers", ()))
        self.buffers = {n for n, _ in meta.named_buffers() if loaded and n.endswith(loaded)}
        expected.update({n: tuple(b.shape) for n, b in meta.named_buffers() if n in self.buffers})
        missing = sorted(set(expected) - set(shapes))
        if missing:
            raise InputError(
                f"model.init_from=hf:{path}: tensor {self.names.to_hf_name(missing[0])} is missing "
                f"({len(missing)} missing): the directory does not hold this model"
            )
        extra = sorted(set(shapes) - set(expected))
        if extra:
            raise InputError(
                f"model.init_from=hf:{path}: unexpected tensor {self.names.to_hf_name(extra[0])} for this model config"
            )
        for name, shape in expected.items():
            if shapes[name] != shape:
                raise InputError(
                    f"model.init_from=hf:{path}: {self.names.to_hf_name(name)} has shape {shapes[name]}, the model "
                    f"config needs {shape}: the weights do not match config.json"
                )
        self.shapes = expected

    def read(self, name: str, shape: Optional[tuple] = None, offset: Optional[tuple] = None) -> Any:
        """Our parameter `name` (its [offset : offset + shape] block when given) as an fp32 tensor."""
        from safetensors import safe_open

        full = self.shapes[name]
        shape = tuple(shape) if shape is not None else full
        offset = tuple(offset) if offset is not None else (0,) * len(full)
        if name in self.stacked:
            return self._read_experts(name, shape, offset)
        if name in self.parts:
            return self._read_part(name, shape, offset)
        rope_heads = getattr(self.names, "rope_heads", None)
        heads = rope_heads(name, self.m) if rope_heads else None
        f, hf_name = self.where[name]
        rows = (offset[0], offset[0] + shape[0]) if shape else (0, 0)
        if heads:
            per = full[0] // heads
            rows_read = (rows[0] // per * per, -(-rows[1] // per) * per)
        else:
            rows_read = rows
        with safe_open(str(self.path / f), framework="pt") as fh:
            sl = fh.get_slice(hf_name)
            index = (slice(*rows_read),) + tuple(slice(o, o + s) for o, s in zip(offset[1:], shape[1:], strict=True))
            t = sl[index] if full else sl[:]
        if heads:
            n = (rows_read[1] - rows_read[0]) // (full[0] // heads)
            t = halves_to_interleaved(t, n) if n else t
            t = t[rows[0] - rows_read[0] : rows[1] - rows_read[0]]
        return t.float().contiguous()

    def _read_part(self, name: str, shape: tuple, offset: tuple) -> Any:
        """A block of a tensor held inside a fused HF tensor: the leading (expert) rows it spans, taken to
        our layout, then cut down (the trailing dims are whole in the file's row, permuted in ours)."""
        from safetensors import safe_open

        hf_name, take, others = self.parts[name]
        rows = []
        for n in (hf_name, *others):
            with safe_open(str(self.path / self.hf_files[n]), framework="pt") as fh:
                rows.append(fh.get_slice(n)[offset[0] : offset[0] + shape[0]])
        t = take(*rows)
        t = t[(slice(None),) + tuple(slice(o, o + s) for o, s in zip(offset[1:], shape[1:], strict=True))]
        return t.float().contiguous()

    def _read_experts(self, name: str, shape: tuple, offset: tuple) -> Any:
        """Experts [offset[0], offset[0] + shape[0]) of a 3-D expert tensor, each cut to its block."""
        import torch
        from safetensors import safe_open

        rows = []
        for e in range(offset[0], offset[0] + shape[0]):
            f, hf_name = self.stacked[name][e]
            with safe_open(str(self.path / f), framework="pt") as fh:
                sl = fh.get_slice(hf_name)
                rows.append(sl[tuple(slice(o, o + s) for o, s in zip(offset[1:], shape[1:], strict=True))])
        return torch.stack(rows).float().contiguous()


def load_hf_weights(path: str | Path, m: Any) -> dict:
    """{our parameter name: full fp32 tensor} from a HF directory, checked against the model config
    (one process: export tests, generate)."""
    w = HFWeights(path, m)
    return {n: w.read(n) for n in w.shapes}


def hf_init_dir(m: Any) -> Optional[str]:
    """The directory of `model.init_from=hf:DIR`, None for random init."""
    src = WeightSource.parse(getattr(m, "init_from", None))
    if src.is_random:
        return None
    if not (src.is_hf and src.name):
        raise InputError(f"model.init_from='{src}' is not a weight source: use random or hf:DIR")
    from dtlaunch.hub.model_source import hf_weights_dir

    return str(hf_weights_dir(str(src)))


_CACHE: dict[tuple[str, str], HFWeights] = {}


def hf_weights(m: Any) -> Optional[HFWeights]:
    """The opened directory of model.init_from (once per process: pipeline stages on one rank share
    it); None for random init."""
    path = hf_init_dir(m)
    if path is None or not _spec(m).hf_names:
        return None  # model.arch=hf_auto reads its own names (its module's init_param)
    from dtlaunch.config.schema import to_dict

    key = (path, json.dumps(to_dict(m), sort_keys=True))
    if key not in _CACHE:
        _CACHE.clear()
        _CACHE[key] = HFWeights(path, m)
        from dtlaunch.run.phases import phase

        # Once per process, on rank 0: which weights the run starts from, so a wrong DIR shows at once.
        w = _CACHE[key]
        n = sum(math.prod(s) for name, s in w.shapes.items() if name not in w.buffers)  # parameters only
        phase(
            f"model.init_from: loaded {len(_CACHE[key].shapes)} tensors ({n:,} parameters) from {path}, slice by slice"
        )
    return _CACHE[key]
