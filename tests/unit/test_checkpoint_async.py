"""An async save copies the state in the background while training goes on: the optimizer step must
wait for that copy, or the checkpoint would hold a mix of two steps. Single process, no process group."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from dtlaunch.job.compose import compose
from dtlaunch.models.dense.model import build_model
from dtlaunch.train.checkpoint.manager import CheckpointManager
from dtlaunch.train.optim import build_optimizer, build_scheduler
from dtlaunch.train.parallel.init_weights import materialize_and_init


def _setup(run_dir: Path) -> tuple:
    cfg = compose(
        ["model=tiny", "hardware=cpu", "training.seq_len=16", "checkpoint.async_save=true", "strategy.dp_shard=1"]
    ).cfg
    torch.manual_seed(0)
    model = build_model(cfg.model, rope_len=16, device="cpu")
    materialize_and_init(model, torch.device("cpu"), seed=0)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    sched = build_scheduler(opt, cfg)
    return cfg, model, opt, sched, CheckpointManager(cfg, run_dir, [model], [opt], [sched], None, rank=0)


def _forward_backward(model: torch.nn.Module, vocab: int) -> None:
    tokens = torch.randint(0, vocab, (2, 17))
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, vocab: int) -> None:
    _forward_backward(model, vocab)
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_optimizer_step_waits_for_the_async_copy(tmp_path: Path) -> None:
    cfg, model, opt, _, mgr = _setup(tmp_path)
    vocab = int(cfg.model.vocab_size)
    _step(model, opt, vocab)
    snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # Hold the background copy until released, so the next optimizer step certainly arrives while it
    # runs; no timing assumption (a loaded machine only makes the step arrive later).
    release = threading.Event()
    stager = mgr._stager._state_dict_stager
    copy = stager.stage
    stager.stage = lambda *a, **k: (release.wait(60), copy(*a, **k))[1]
    mgr.save(1)
    _forward_backward(model, vocab)
    stepper = threading.Thread(target=opt.step)  # changes every parameter in place, once the copy is done
    stepper.start()
    stepper.join(timeout=1.0)
    assert stepper.is_alive(), "the optimizer step did not wait for the checkpoint's background copy"
    release.set()
    stepper.join(timeout=60)
    assert not stepper.is_alive()
    assert mgr.blocked_s > 0
    mgr.close()
    assert not torch.equal(next(iter(model.parameters())), next(iter(snapshot.values())))

    _, fresh, _, _, loader_mgr = _setup(tmp_path)
    assert loader_mgr.resume() == 1
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, snapshot[k]), k
