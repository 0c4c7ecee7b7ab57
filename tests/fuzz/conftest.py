"""The intact inputs the fuzz suite spoils (built once per session, copied for every case): a Hugging
Face directory in one file and in shards with an index, a peft adapter of it, a chat job (tokenizer,
records, template), token shards and a run directory with two checkpoints."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

CHAT_RECORD = {"messages": [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3 w4"}]}
TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="session")
def fuzz_inputs(tiny_hf_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    import numpy as np
    import torch

    from dtlaunch.data.shards import ShardWriter

    root = tmp_path_factory.mktemp("fuzz_inputs")
    hf = root / "hf"
    shutil.copytree(tiny_hf_dirs["qwen2"], hf)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf)
    sharded = root / "hf_sharded"
    model.save_pretrained(sharded, max_shard_size="150KB")  # an index and several files
    shutil.copy(hf / "tokenizer.json", sharded)
    (sharded / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<eos>"}))
    lora = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    lora.save_pretrained(root / "adapter")
    chat = root / "chat"
    chat.mkdir()
    shutil.copy(hf / "tokenizer.json", chat)
    (chat / "chat.jsonl").write_text("\n".join(json.dumps(CHAT_RECORD) for _ in range(40)) + "\n")
    (chat / "template.jinja").write_text(TEMPLATE)
    w = ShardWriter(root / "shards", np.uint16, 2000)
    w.add(np.arange(5000, dtype=np.uint16) % 250)
    w.close({"vocab_size": 260, "tokenizer": "byte"})
    return {
        "hf": hf,
        "hf_sharded": sharded,
        "adapter": root / "adapter",
        "chat": chat,
        "shards": root / "shards",
        "run": _run_with_checkpoints(root / "run"),
    }


def _run_with_checkpoints(run_dir: Path) -> Path:
    """Two small checkpoints written in-process by the real CheckpointManager, and the run's config."""
    import torch
    from omegaconf import OmegaConf

    from dtlaunch.job.compose import compose
    from dtlaunch.models.dense.model import build_model
    from dtlaunch.train.checkpoint.manager import CheckpointManager
    from dtlaunch.train.optim import build_optimizer, build_scheduler
    from dtlaunch.train.parallel.init_weights import materialize_and_init

    cfg = compose(["model=tiny", "model.n_layers=1", "hardware=cpu", "training.seq_len=8", "strategy.dp_shard=1"]).cfg
    model = build_model(cfg.model, rope_len=8, device="cpu")
    materialize_and_init(model, torch.device("cpu"), seed=0)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    mgr = CheckpointManager(cfg, run_dir, [model], [opt], [build_scheduler(opt, cfg)], None, rank=0)
    with contextlib.redirect_stdout(io.StringIO()):
        mgr.save(1)
        mgr.save(2)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    return run_dir
