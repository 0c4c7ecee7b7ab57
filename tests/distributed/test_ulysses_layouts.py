"""Ulysses sequence parallel (`strategy.cp_style=ulysses`) against one process: 2 forked gloo workers split
every sequence over strategy.cp=2 (the loader's load-balanced chunks, the tokens' true positions) and
exchange q/k/v and the attention output with all_to_all_single around attention; the pytest process
trains the same global batch with the same code and no mesh. fp32, 3 steps: losses and gradient norms
within TOL relative. Layouts: FSDP2 and DDP over the CP ranks, grouped-query K/V heads repeated
(1 K/V head over cp=2), LoRA adapters under FSDP2, and a transformers model (model.arch=hf_auto, a tiny
Qwen2 from transformers' config class) whose attention runs through transformers' attention registry.
Ring attention runs on the same batches as a check of the harness's chunks."""

from __future__ import annotations

import pytest
from forked_training import run_forked, train

pytestmark = pytest.mark.slow

STEPS = 3
TOL = 1e-6
COMMON = ["training.seq_len=32", "optim.warmup_steps=1", "optim.lr=1e-2", "training.global_batch=4"]
CP2 = ["strategy.cp=2", "strategy.dp_shard=1", "launch.nproc_per_node=2", "training.micro_batch=4"]
ULYSSES = [*CP2, "strategy.cp_style=ulysses"]
# name -> (model and method overrides, shared with the one-process reference; the layout's own overrides)
LAYOUTS: dict[str, tuple[list[str], list[str]]] = {
    "ring_fsdp": (["recipe=tiny_fsdp"], CP2),
    "ulysses_fsdp": (["recipe=tiny_fsdp"], ULYSSES),
    "ulysses_ddp": (["recipe=tiny_ddp"], ULYSSES),
    "ulysses_kv_repeat": (["recipe=tiny_fsdp", "model.n_kv_heads=1"], ULYSSES),
    "ulysses_lora_fsdp": (["recipe=tiny_fsdp", "peft=lora"], ULYSSES),
    "ulysses_hf_auto": (["recipe=tiny_fsdp", "model=tiny", "model.arch=hf_auto", "HF_QWEN2"], ULYSSES),
}


def _model(overrides: list[str], hf_dir: str) -> list[str]:
    return [f"model.init_from=hf:{hf_dir}" if o == "HF_QWEN2" else o for o in overrides]


def _attention(rt) -> str:
    """Which attention the model runs: the registry decoder's attention_fn, or transformers' implementation."""
    model = rt.model_parts[0]
    fns = {type(m.attention_fn).__name__ for m in model.modules() if hasattr(m, "attention_fn")}
    return ",".join(sorted(fns)) or model.config._attn_implementation


@pytest.fixture(scope="module")
def hf_dir(tiny_hf_dirs) -> str:
    return str(tiny_hf_dirs["qwen2"])


@pytest.fixture(scope="module")
def launched(hf_dir, tmp_path_factory) -> dict:
    def run_all() -> dict:
        return {
            name: train([*_model(model, hf_dir), *COMMON, *layout], 2, STEPS, inspect=_attention)
            for name, (model, layout) in LAYOUTS.items()
        }

    return run_forked(2, run_all, tmp_path_factory.mktemp("ulysses") / "results.json")


@pytest.fixture(scope="module")
def references(hf_dir) -> dict:
    """One process per model: the same global batch of 4 in one micro-batch."""
    cache: dict = {}
    one = ["launch.nproc_per_node=1", "training.micro_batch=4"]
    for model, _ in LAYOUTS.values():
        key = tuple(model)
        if key not in cache:
            cache[key] = train([*_model(model, hf_dir), *COMMON, *one], 1, STEPS)
    return cache


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cp_style_matches_one_process(name: str, launched, references) -> None:
    got, ref = launched[name], references[tuple(LAYOUTS[name][0])]
    want = {"ring_fsdp": "RingAttention", "ulysses_hf_auto": "dtlaunch_ulysses"}.get(name, "UlyssesAttention")
    assert got["inspect"] == want
    assert ref["loss"][-1] < ref["loss"][0]  # the updates move the loss
    for key in ("loss", "grad_norm"):
        for a, b in zip(got[key], ref[key], strict=True):
            assert abs(a - b) <= TOL * abs(b), (name, key, got[key], ref[key])
