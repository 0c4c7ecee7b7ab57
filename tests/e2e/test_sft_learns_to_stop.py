"""A tiny model fine-tuned on 8 prompt/completion records at micro_batch=1 (one process, and FSDP over 2
processes) continues each training prompt with exactly its completion and then stops: the completion's EOS
is a target (as TRL's SFTTrainer trains it), and generation stops there. Before, micro_batch=1 crashed on
masked data and, at larger micro-batches, the model ran on to --max-new-tokens."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")

STEPS = 60


def pairs() -> list[tuple[str, str]]:
    rng = random.Random(5)
    out = []
    for i in range(8):
        prompt = " ".join(f"w{rng.randint(0, 249)}" for _ in range(rng.randint(2, 5)))
        out.append((prompt, " " + " ".join(f"w{rng.randint(0, 249)}" for _ in range(2 + i % 4))))
    return out


@pytest.mark.parametrize("world", [1, 2], ids=["one_process", "fsdp2"])
def test_fine_tuned_model_answers_each_prompt_and_stops(world: int, trainer, tiny_hf_dirs, tmp_path: Path) -> None:
    from dtlaunch.infer.generate import generate_ids, load_source, set_positions

    model = tiny_hf_dirs["qwen2"]
    data = tmp_path / "pc.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in pairs()))
    run = tmp_path / "run"
    args = ["train", "recipe=tiny_fsdp", f"model.init_from=hf:{model}", "data.kind=jsonl", f"data.path={data}"]
    args += ["data.format=prompt_completion", "data.pack=false", f"data.cache_dir={tmp_path / 'cache'}"]
    args += ["training.seq_len=16", "training.micro_batch=1", "training.global_batch=8", f"training.steps={STEPS}"]
    args += ["optim.lr=1e-2", "optim.warmup_steps=5", "optim.schedule=constant", "optim.weight_decay=0"]
    args += [f"checkpoint.every_steps={STEPS}", "training.loss_plot=false", f"launch.nproc_per_node={world}"]
    args += ["launch.threads_per_worker=1", "logging.trackers=[]", f"run.dir={run}"]  # no TensorBoard imports
    proc = trainer.cli(args)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "data.path: 8 prompt_completion records" in proc.stdout
    loaded = load_source(str(run), torch.device("cpu"))
    assert loaded.eos_id is not None and loaded.eos_id in loaded.stop_ids
    for prompt, completion in pairs():
        ids = [int(i) for i in loaded.tokenizer.encode(prompt.encode())]
        set_positions(loaded.model, len(ids) + 12)
        new = generate_ids(loaded.model, ids, 12, eos_id=loaded.eos_id, stop=loaded.stop_ids)
        want = [int(i) for i in loaded.tokenizer.encode(completion.encode())]
        assert new == [*want, loaded.eos_id], (prompt, completion, loaded.tokenizer.decode(new))
