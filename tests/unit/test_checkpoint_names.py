"""The model tensors a checkpoint holds (dtlaunch.train.checkpoint.states.saved_model_tensors): one
definition for the writer (ModelState) and the launcher's resume check (dtlaunch.launch.preflight).

A tied head is one Parameter under two names; named_parameters() lists it once, the checkpoint holds
both. The resume check once built its names from named_parameters() and refused every tied run's own
checkpoint ("written for a different model ... tensor output.weight: checkpoint (512, 64), config absent").
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

# An MoE entry with the auxiliary-loss-free balancing: its routers hold a persistent buffer (expert_bias).
MOE = ["model=tiny_moe", "model.moe.bias_update_rate=0.001"]


def build(*overrides: str, device: str = "meta") -> tuple:
    from dtlaunch.job.compose import compose
    from dtlaunch.models.registry import model_spec
    from dtlaunch.train.features.peft import apply_peft

    cfg = compose(["model=tiny", *overrides]).cfg
    model = model_spec(cfg.model).build(cfg.model, rope_len=16, device=device)
    apply_peft(model, cfg)
    return cfg, model


@pytest.mark.parametrize(
    ("arch", "tied"), [("llama", False), ("llama", True), ("qwen2", True), ("qwen3", True), ("llama_moe", True)]
)
def test_saved_names_are_the_state_dict_tied_head_included(arch: str, tied: bool) -> None:
    from dtlaunch.models.saved_tensors import saved_model_tensors

    extra = [*MOE] if arch == "llama_moe" else [f"model.arch={arch}"]
    _, model = build(*extra, f"model.tie_embeddings={str(tied).lower()}")
    names = saved_model_tensors(model, trainable_only=False)
    assert list(names) == list(model.state_dict())
    assert "output.weight" in names and "tok_embeddings.weight" in names
    assert (names["output.weight"] is names["tok_embeddings.weight"]) == tied
    if tied:  # the names the old check expected (parameters once each, and buffers): one short
        listed = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
        assert set(names) - listed == {"output.weight"}
    if arch == "llama_moe":  # persistent buffers (the router's expert bias) are saved too
        assert any(n.endswith("router.expert_bias") for n in names), sorted(names)


def test_peft_saves_the_adapters_under_every_name_and_never_the_tied_base() -> None:
    from dtlaunch.models.saved_tensors import saved_model_tensors

    _, model = build("model.tie_embeddings=true", "peft=lora")
    names = saved_model_tensors(model, trainable_only=True)
    assert names and all(".lora_" in n for n in names), sorted(names)
    assert set(names) == {n for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.tie_embeddings=true"],
        ["model.arch=qwen2", "model.tie_embeddings=true"],
        ["model.tie_embeddings=true", "peft=lora"],
        [*MOE, "model.tie_embeddings=true"],
        [],
    ],
    ids=["llama_tied", "qwen2_tied", "llama_tied_lora", "moe_tied", "llama_untied"],
)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP on one process, as asked
def test_the_writers_checkpoint_passes_the_resume_check(overrides: list[str], tmp_path: Path) -> None:
    """ModelState writes a checkpoint (DCP, one process); check_model_matches accepts it for its config."""
    import torch.distributed.checkpoint as dcp

    from dtlaunch.config.schema import to_dict
    from dtlaunch.convert.base_fingerprint import peft_record
    from dtlaunch.launch.preflight import check_model_matches
    from dtlaunch.train.checkpoint.states import ModelState, saved_model_tensors
    from dtlaunch.train.features.peft import peft_enabled

    cfg, model = build(*overrides, device="cpu")
    state = ModelState([model], trainable_only=peft_enabled(cfg))
    dcp.save({"model": state}, checkpoint_id=str(tmp_path), no_dist=True)
    saved = {k for k in dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata}
    assert saved == {f"model.{n}" for n in saved_model_tensors(model, peft_enabled(cfg))}
    marker = {"model": dict(to_dict(cfg)["model"]), "peft": peft_record(cfg)}
    check_model_matches(cfg, SimpleNamespace(path=tmp_path, name="step-00000001", marker=marker))
