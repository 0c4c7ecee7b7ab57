"""The checkpoint's Stateful containers (dtlaunch/train/checkpoint/states.py) on one process: what `state_dict()`
returns, `load_state_dict()` puts back (model, optimizer moments and step, LR schedule), over a model
split into two parts, as the checkpoint manager saves them in one dict."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.stateful import Stateful

from dtlaunch.job.compose import compose
from dtlaunch.models.dense.model import build_model
from dtlaunch.train.checkpoint.states import train_states
from dtlaunch.train.optim import build_optimizer, build_scheduler
from dtlaunch.train.parallel.init_weights import materialize_and_init


def _trained(seed: int) -> tuple:
    cfg = compose(["model=tiny", "training.seq_len=16", "optim.warmup_steps=2"]).cfg
    torch.manual_seed(seed)
    model = build_model(cfg.model, rope_len=16, device="cpu")
    materialize_and_init(model, torch.device("cpu"), seed=seed)
    # Two parts (blocks 0 and 1) with their optimizers and schedulers, as pipeline stages on one rank.
    parts = [torch.nn.ModuleDict({k: model.layers[k]}) for k in ("0", "1")]
    opts = [build_optimizer(p, cfg, torch.device("cpu")) for p in parts]
    scheds = [build_scheduler(o, cfg) for o in opts]
    for _ in range(seed + 1):  # different step counts, moments and learning rates per seed
        model(torch.randint(0, int(cfg.model.vocab_size), (2, 16))).square().mean().backward()
        for o, s in zip(opts, scheds, strict=True):
            o.step()
            o.zero_grad()
            s.step()
    return parts, opts, scheds


def _plain(sd: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}


def test_states_round_trip() -> None:
    src, dst = train_states(*_trained(1)), train_states(*_trained(2))
    assert set(src) == {"model", "optim", "schedulers"} and all(isinstance(s, Stateful) for s in src.values())
    saved = {name: _plain(s.state_dict()) for name, s in src.items()}
    assert "state.0.attention.wq.weight.exp_avg" in saved["optim"]  # flattened by parameter name
    assert any(not torch.equal(v, dst["model"].state_dict()[k]) for k, v in saved["model"].items())
    for name, s in dst.items():
        s.load_state_dict(saved[name])
    for name, s in dst.items():
        got = s.state_dict()
        assert set(got) == set(saved[name])
        for k, v in saved[name].items():
            assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, (name, k)
