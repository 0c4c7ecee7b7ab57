"""Build transformers' AutoModelForCausalLM from DIR/config.json and fit it to the runtime's protocol.

- its decoder layers (a ModuleList) are replaced, in place, by a `LayerDict`: a ModuleDict keyed by
  block index that also iterates and slices like the list transformers' forward loops over, so FSDP,
  activation checkpointing and compile wrapping an entry change what the forward runs; parameter
  names stay transformers' own (the dict is registered where the list was);
- `forward(tokens)` returns the logits tensor (the class is swapped for a subclass, no wrapper module);
- `init_param(name, shape, seed)` reads that parameter from DIR's safetensors (the weights come from
  model.init_from; there is no seeded init of a foreign architecture);
- `buffer_values(device)` rebuilds the modules that own buffers (rotary tables) on `device`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from dtlaunch.config.weight_source import WeightSource
from dtlaunch.errors import ConfigError, InputError

if TYPE_CHECKING:
    from dtlaunch.config.schema import ModelConfig


class LayerDict(nn.ModuleDict):
    def __iter__(self):  # transformers iterates modules, a ModuleDict its keys
        return iter(self._modules.values())

    def __getitem__(self, idx: Any) -> Any:
        if isinstance(idx, (int, slice)):
            return list(self._modules.values())[idx]
        return super().__getitem__(idx)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError("model.arch=hf_auto needs transformers: pip install 'dtlaunch[hf]'") from exc
    return transformers


def _source(m: ModelConfig) -> Path:
    if not WeightSource.parse(m.init_from).is_hf:
        raise ConfigError(
            "model.arch=hf_auto needs model.init_from=hf:DIR (the architecture and weights come from DIR)"
        )
    from dtlaunch.hub.model_source import hf_source_dir

    return Path(str(hf_source_dir(m.init_from)))


def build_model(m: Any, rope_len: Optional[int] = None, device: Any = "meta") -> nn.Module:
    transformers = _transformers()
    path = _source(m)
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise ConfigError(f"model.init_from=hf:{path}: transformers cannot read its config.json ({exc})") from exc
    with torch.device(device):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        except Exception as exc:
            raise ConfigError(f"model.arch=hf_auto: transformers cannot build {config.architectures} ({exc})") from exc
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    blocks = getattr(decoder, "layers", None)
    if not isinstance(blocks, nn.ModuleList):
        raise ConfigError(
            f"model.arch=hf_auto: {type(model).__name__} keeps no decoder `layers` list, which FSDP and "
            f"activation checkpointing wrap: not supported"
        )
    layers = LayerDict({str(i): b for i, b in enumerate(blocks)})
    decoder.layers = layers
    base = type(model)

    def logits(
        self: nn.Module,
        tokens: torch.Tensor,
        positions: Optional[torch.Tensor] = None,
        doc_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        # The runtime's protocol: token ids in, the logits tensor out (no cache, no output object).
        # `positions`: the tokens' positions when they are not 0..S-1 (context parallel's chunks), (S,) or
        # (B, S), as transformers' position_ids (its rotary tables follow them). Packed documents
        # (data.document_mask): their positions restart at each document, from which transformers' mask
        # keeps each document to itself (masking_utils.find_packed_sequence_indices); `doc_ids` says no more.
        ids = None if positions is None else positions.expand(tokens.shape[0], -1)
        return base.forward(self, input_ids=tokens, position_ids=ids, use_cache=False).logits

    def forward(
        self: nn.Module,
        tokens: torch.Tensor,
        positions: Optional[torch.Tensor] = None,
        doc_ids: Optional[torch.Tensor] = None,
        head: bool = True,
    ) -> torch.Tensor:
        # `head=False`: the decoder's normed hidden states (the trainer's chunked loss applies the head).
        if head:
            return logits(self, tokens, positions, doc_ids)
        ids = None if positions is None else positions.expand(tokens.shape[0], -1)
        return self.get_decoder()(input_ids=tokens, position_ids=ids, use_cache=False).last_hidden_state

    # The `head` argument only where the logits are the head's plain output (a model without it trains with
    # the plain loss: dtlaunch.train.loss.head_loss refuses loss_chunks > 1 for it).
    plain = _plain_head(model, config)
    methods = {"forward": forward if plain else logits, "init_param": _init_param, "buffer_values": _buffer_values}
    model.__class__ = type(f"HFAuto{base.__name__}", (base,), methods)
    object.__setattr__(model, "layers", layers)  # not registered twice: names stay transformers' own
    object.__setattr__(model, "cfg", m)
    object.__setattr__(model, "rope_len", rope_len)
    model._hf_dir = path
    return model


def _plain_head(model: nn.Module, config: Any) -> bool:
    """The logits are `lm_head(last_hidden_state)` and nothing more: a bias-free linear head, no logit
    soft-capping (Gemma 2/3) or scaling (Cohere) after it, which a chunked loss would skip."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or head.bias is not None or not hasattr(model, "get_decoder"):
        return False
    return getattr(config, "final_logit_softcapping", None) is None and getattr(config, "logit_scale", None) in (
        None,
        1.0,
    )


def _init_param(self: nn.Module, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    from safetensors import safe_open

    path = self._hf_dir
    index = path / "model.safetensors.index.json"
    files = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    f = files.get(name) if files is not None else "model.safetensors"
    if f is None or not (path / f).is_file():
        raise InputError(f"model.init_from=hf:{path}: tensor {name} is missing")
    with safe_open(str(path / f), framework="pt") as fh:
        if name not in fh.keys():
            raise InputError(f"model.init_from=hf:{path}: tensor {name} is missing")
        t = fh.get_tensor(name)
    if tuple(t.shape) != tuple(shape):
        raise InputError(
            f"model.init_from=hf:{path}: {name} has shape {tuple(t.shape)}, the model needs {tuple(shape)}"
        )
    return t.float()


def _buffer_values(self: nn.Module, device: Any = None) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for mod_name, mod in self.named_modules():
        own = dict(mod.named_buffers(recurse=False))
        if not own:
            continue
        with torch.device(device or "cpu"):
            fresh = type(mod)(config=self.config)
        for b, value in fresh.named_buffers(recurse=False):
            out[f"{mod_name}.{b}" if mod_name else b] = value
    return out
