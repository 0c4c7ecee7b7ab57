"""Mixture-of-experts training through the CLI.

- Two FSDP2 processes, or a two-stage pipeline (gloo), train a tiny MoE with the aux loss and the bias
  update on; a plain single-process torch loop (AdamW, the same seeded init and the two ranks' batches as two accumulation
  micro-batches) gives the same losses and grad norms within 1e-4, and the same router statistics.
(The Qwen3-MoE directory's export round trip is a case of tests/e2e/test_hf_families_train.py's export test.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

STEPS = 3
PARITY = [
    "model=tiny_moe",
    "model.moe.aux_loss_coef=0.05",
    "model.moe.bias_update_rate=0.01",
    f"training.steps={STEPS}",
    "training.seq_len=32",
    "training.grad_clip=100",
    "optim.weight_decay=0",
    "optim.warmup_steps=0",
    "optim.schedule=constant",
    "launch.nproc_per_node=2",
]
# Both give the one-process loop's two micro-batches of 2 sequences: two FSDP ranks, or one pipeline
# of two stages over two micro-batches (its first forward is torch's metadata pass: not counted).
LAYOUTS = {
    "fsdp": ["strategy=fsdp", "training.micro_batch=2"],
    "pp": ["strategy=pp", "training.micro_batch=4", "strategy.pp_microbatches=2"],
}


def _reference(run: Path) -> list[dict]:
    """One process: both ranks' batches as two micro-batches of one step, AdamW, the same bias update."""
    from dtlaunch.job.compose import load_resolved
    from dtlaunch.models.moe import balance
    from dtlaunch.models.registry import model_spec
    from dtlaunch.train.data import build_loaders

    cfg = load_resolved(run / "config.yaml")
    m, o = cfg.model, cfg.optim
    model = model_spec(m).build(m, rope_len=int(cfg.training.seq_len), device="cpu")
    model.init_weights(int(cfg.training.seed))
    balance.set_aux_grad_scale([model], 0.5)
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=0.0)
    cfg.training.micro_batch = 2  # what one FSDP rank or one pipeline micro-batch computes
    loaders = [build_loaders(cfg, run, r, 2)[0] for r in (0, 1)]
    out = []
    for _ in range(STEPS):
        losses = []
        for loader in loaders:
            batch = loader.next_batch()
            x, y = batch.inputs, batch.targets
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            (loss / 2).backward()
            losses.append(loss.item())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 100.0)
        opt.step()
        opt.zero_grad()
        balance.update_expert_bias(model, lambda t: t, float(m.moe.bias_update_rate))
        out.append({"loss": sum(losses) / 2, "grad_norm": norm.item(), **balance.router_stats(model, lambda t: t)})
        balance.reset([model])
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_processes_match_one_process_loop(trainer, tmp_path, layout: str) -> None:
    run = tmp_path / layout
    trainer.run(run, *PARITY, *LAYOUTS[layout])
    got, ref = trainer.metrics(run), _reference(run)
    assert len(got) == STEPS
    for g, r in zip(got, ref, strict=True):
        assert abs(g["loss"] - r["loss"]) < 1e-4 and abs(g["grad_norm"] - r["grad_norm"]) < 1e-4, (g, r)
        assert g["moe_tokens_per_expert"] == r["moe_tokens_per_expert"]
        assert abs(g["moe_imbalance_max"] - r["moe_imbalance_max"]) < 1e-9
        assert abs(g["moe_aux_loss"] - r["moe_aux_loss"]) < 1e-5
    assert ref[0]["loss"] - ref[-1]["loss"] > 1e-3  # the updates moved the model
    assert sum(got[0]["moe_tokens_per_expert"]) == 2 * 2 * 32 * 2 * 4  # ranks x batch x seq x top-2 x layers
