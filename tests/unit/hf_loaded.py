"""A tiny Hugging Face directory loaded both ways, for the families' parity tests: dtlaunch's model through
`model.init_from=hf:DIR` (every tensor and persistent buffer from the directory) and transformers' own."""

from __future__ import annotations

import torch

from dtlaunch.config.compose import compose
from dtlaunch.convert.hf import load_hf_weights
from dtlaunch.models.registry import model_spec


def ours(path, seq: int = 32) -> tuple[torch.nn.Module, object]:
    m = compose(["model=tiny", f"model.init_from=hf:{path}"]).cfg.model
    model = model_spec(m).build(m, rope_len=seq, device="cpu")
    model.init_weights(0)  # buffers; the weights (and a router's correction bias) come next
    result = model.load_state_dict(load_hf_weights(path, m), strict=False)
    assert not result.unexpected_keys and not result.missing_keys, result
    return model.eval(), m


def theirs(path) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
