"""Text generation with dtlaunch's own model modules (the ones that train) and a KV cache, one process.

SOURCE is `hf:DIR` (config.json, safetensors, tokenizer.json), a run directory (its newest complete
checkpoint and the run's tokenizer) or a checkpoint directory inside a run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from dtlaunch.config.weight_source import hf_name
from dtlaunch.errors import InputError
from dtlaunch.run.run_dir import TOKENIZER_FILE

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


@dataclass
class Loaded:
    model: torch.nn.Module
    m: Any  # the model section
    tokenizer: Any
    eos_id: Optional[int]
    source: str
    tokenizer_file: str = ""  # the tokenizer.json it came from ("byte" for the byte tokenizer)
    # Every id that ends a continuation, as transformers' generate stops: the tokenizer's EOS and each
    # eos_token_id of the model's generation_config.json and config.json (an int or a list: end-of-turn ids).
    stop_ids: tuple[int, ...] = ()


def load_source(source: str, device: torch.device, max_len: int = 1, adapter: str = "") -> Loaded:
    """The model (weights loaded, eval mode, RoPE for `max_len` positions: see set_positions) and
    its tokenizer. A LoRA run's adapters, or a peft adapter directory (`adapter`, with an hf: source),
    are merged into the base's weights (dtlaunch.convert.adapters)."""
    name = hf_name(source)
    if adapter and name is None:
        raise InputError(f"--adapter {adapter}: adapters go on an hf:DIR base; a run directory brings its own")
    from dtlaunch.data.tokenizer import load_tokenizer
    from dtlaunch.job.model_schema import typed_model
    from dtlaunch.models.registry import model_spec

    if name is not None:
        from dtlaunch.convert.hf import load_hf_weights
        from dtlaunch.hub.model_source import hf_weights_dir, read_hf_config
        from dtlaunch.job.hf_model import model_fields_from_hf
        from dtlaunch.job.tokenizer_choice import model_tokenizer_file

        path = Path(str(hf_weights_dir(source)))  # hf:ORG/NAME: its cached snapshot, weights fetched once
        model_tokenizer_file(source)  # and its tokenizer files (a directory: only looked up)
        c = read_hf_config(path)
        fields = model_fields_from_hf(path, c)
        m = typed_model({**fields, "name": Path(name.partition("@")[0]).name})
        state = load_hf_weights(path, m)
        if adapter:
            from dtlaunch.convert.adapters import load_peft_dir, merge

            state = merge(state, load_peft_dir(Path(adapter).expanduser(), m, path), f"--adapter {adapter}")
        tok_file = path / TOKENIZER_FILE
        if not tok_file.is_file():
            raise InputError(f"generate {source}: no tokenizer.json in {path}: add the model's tokenizer.json")
        tokenizer_file = str(tok_file)
        tokenizer = load_tokenizer(tokenizer_file)
        eos = c.get("eos_token_id")
        eos_id = (eos[0] if isinstance(eos, list) and eos else eos) if eos is not None else tokenizer.eos_id
        model_dir: Optional[Path] = path
    else:
        from dtlaunch.convert.hf import load_checkpoint_model
        from dtlaunch.run.checkpoints import resolve_load_path

        if resolve_load_path(Path(source))[0].marker.get("peft"):  # a LoRA run: its base + its adapters
            from dtlaunch.convert.adapters import merged_run_state

            state, m, info = merged_run_state(Path(source))
        else:
            state, m, info = load_checkpoint_model(Path(source))
        if str(m.arch) == "hf_auto":  # decoding runs the native modules' KV cache, which transformers' lack
            raise InputError(
                f"generate {source}: a model.arch=hf_auto run is not decoded by dtlaunch generate: export it "
                f"(dtlaunch ckpt export {source} --format hf --out DIR) and generate with transformers"
            )
        tokenizer_file = _run_tokenizer(Path(info.path))
        tokenizer = load_tokenizer(tokenizer_file)
        eos_id = getattr(tokenizer, "eos_id", None)
        model_dir = _run_base_dir(Path(info.path))
    model = model_spec(m).build(m, rope_len=max_len, device=device)
    model.init_weights(0)  # derived buffers (RoPE); every weight is then loaded
    result = model.load_state_dict({k: v for k, v in state.items()}, strict=False)
    missing = [k for k in result.missing_keys if not (k == "output.weight" and m.tie_embeddings)]
    if missing or result.unexpected_keys:
        raise InputError(f"generate {source}: weights do not fit the model ({(missing + result.unexpected_keys)[0]})")
    stops = stop_ids(model_dir, getattr(tokenizer, "eos_id", None), eos_id)
    return Loaded(model.eval(), m, tokenizer, eos_id, source, tokenizer_file, stops)


def stop_ids(model_dir: Optional[Path], *known: Optional[int]) -> tuple[int, ...]:
    """`known` ids (the tokenizer's EOS) and every eos_token_id that model_dir's generation_config.json and
    config.json list, in that order, each once."""
    found: list[int] = [i for i in known if isinstance(i, int)]
    for name in ("generation_config.json", "config.json"):
        file = model_dir / name if model_dir is not None else None
        if file is None or not file.is_file():
            continue
        try:
            value = json.loads(file.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue  # config.json was checked when the model loaded; a broken generation config sets no stops
        found += [i for i in (value if isinstance(value, list) else [value]) if isinstance(i, int)]
    return tuple(dict.fromkeys(found))


def _run_base_dir(checkpoint: Path) -> Optional[Path]:
    """The local hf:DIR a run started from (its generation_config.json lists the end-of-turn ids), if any."""
    from dtlaunch.job.compose import load_resolved
    from dtlaunch.run.run_dir import RunDir

    run = RunDir.of_checkpoint(checkpoint)
    name = hf_name(load_resolved(run.config).model.init_from) if run and run.config.is_file() else None
    local = Path(name).expanduser() if name else None
    return local if local is not None and local.is_dir() else None


def set_positions(model: torch.nn.Module, length: int) -> None:
    """Rebuild the model's derived position tables (RoPE) for `length` positions."""
    model.rope_len = length
    for name, value in model.buffer_values(next(model.parameters()).device).items():
        setattr(model, name, value)


def _run_tokenizer(checkpoint: Path) -> str:
    """The tokenizer a checkpoint's run trained with (its config.yaml's data.tokenizer)."""
    from dtlaunch.job.compose import load_resolved
    from dtlaunch.run.run_dir import RunDir

    run = RunDir.of_checkpoint(checkpoint)
    if run is None:
        return "byte"
    if run.tokenizer.is_file():  # the launcher's copy of the run's tokenizer
        return str(run.tokenizer)
    return _configured_tokenizer(load_resolved(run.config))


def _configured_tokenizer(cfg: JobConfig) -> str:
    """data.tokenizer of a run without a kept tokenizer (runs from before the launcher kept one). Its ids
    on synthetic data are the model's own, so such a run from hf:DIR decodes with DIR's tokenizer."""
    from dtlaunch.job.tokenizer_choice import effective_tokenizer, model_tokenizer_file

    own = model_tokenizer_file(cfg.model.init_from)
    if str(cfg.data.kind) == "synthetic" and own is not None:
        return str(own)
    return effective_tokenizer(cfg)


def generate_ids(
    model: torch.nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: Optional[int] = None,
    stop: Sequence[int] = (),
) -> list[int]:
    """New token ids after `prompt` (the EOS id, or the `stop` id, included when it ends the text): one row
    of dtlaunch.infer.batch_generate, the path objective=grpo's rollouts take, so `dtlaunch generate` shows
    what a rollout would sample."""
    from dtlaunch.infer.batch_generate import Sampling, generate_batch

    device = next(model.parameters()).device
    stops = set(stop) | ({int(eos_id)} if eos_id is not None else set())
    generator = torch.Generator(device=device).manual_seed(seed)
    s = Sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    return generate_batch(model, [prompt], s, stops, generator=generator).completions[0]
