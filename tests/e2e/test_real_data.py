"""Real data sources through `dtlaunch train`: one corpus written as JSONL, Parquet, a `save_to_disk`
dataset and local data files for `datasets`, trained in five layouts (one process, DDP, FSDP, TP, PP).

The same documents give the same tokens whatever the source, so every layout must log the same
training loss and the same validation loss (held-out split, evaluated every 3 steps and at the last)
within 1e-4; a run killed mid-way resumes bit-identically with evaluation on; the TP run's W&B
(offline) and MLflow (local) records are read back with the libraries' own readers.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TOL = 1e-4
STEPS = 6
EVAL_STEPS = [3, 6]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory, tiny_docs) -> dict[str, Path]:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("corpus")
    docs = tiny_docs(300)
    records = [{"id": i, "text": d} for i, d in enumerate(docs)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), root / "train.parquet")
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(root / "saved"))
    chats = [
        {
            "messages": [
                {"role": "system", "content": d[:20].strip()},
                {"role": "user", "content": d[: len(d) // 2].strip()},
                {"role": "assistant", "content": d[len(d) // 2 :].strip()},
            ]
        }
        for d in docs
    ]
    (root / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    (root / "files").mkdir()
    (root / "files" / "part-0.jsonl").write_text((root / "train.jsonl").read_text())
    return {
        "jsonl": root / "train.jsonl",
        "parquet": root / "train.parquet",
        "saved": root / "saved",
        "files": root / "files",
        "chat": root / "chat.jsonl",
    }


LAYOUTS = {
    "single_jsonl": ["recipe=tiny_ddp", "launch.nproc_per_node=1", "training.micro_batch=4", "data.kind=jsonl"],
    "ddp_parquet": ["recipe=tiny_ddp", "training.micro_batch=2", "data.kind=parquet"],
    "fsdp_hf_saved": ["recipe=tiny_fsdp", "training.micro_batch=2", "data.kind=hf"],
    "tp_hf_files": [
        "recipe=tiny_tp",
        "training.micro_batch=4",
        "data.kind=hf",
        "logging.trackers=[tensorboard,wandb,mlflow]",
        "training.loss_plot=true",
    ],
    "pp_jsonl": ["recipe=tiny_pp", "training.micro_batch=4", "data.kind=jsonl"],
}
# Chat data (loss on assistant tokens only, attention within each conversation) in one process, FSDP and TP
# (vocabulary-parallel loss, sequence parallel attention with the document mask).
CHAT_LAYOUTS = {
    "single_chat": ["recipe=tiny_ddp", "launch.nproc_per_node=1", "training.micro_batch=4"],
    "fsdp_chat": ["recipe=tiny_fsdp", "training.micro_batch=2"],
    "tp_chat": ["recipe=tiny_tp", "training.micro_batch=4"],
}
PATHS = {
    "single_jsonl": "jsonl",
    "ddp_parquet": "parquet",
    "fsdp_hf_saved": "saved",
    "tp_hf_files": "files",
    "pp_jsonl": "jsonl",
}


@pytest.fixture(scope="session")
def data_args(corpus, tiny_tokenizer, tmp_path_factory) -> dict[str, list[str]]:
    cache = tmp_path_factory.mktemp("token_cache")
    common = [
        f"training.steps={STEPS}",
        "training.seq_len=32",
        "optim.warmup_steps=2",
        "optim.lr=1e-2",
        "checkpoint.every_steps=2",
        "launch.threads_per_worker=1",
        "training.loss_plot=false",
        f"data.tokenizer={tiny_tokenizer / 'tokenizer.json'}",
        f"data.cache_dir={cache}",
        "data.val_fraction=0.1",
        "training.eval_every=3",
        "training.eval_batches=2",
    ]
    out = {name: [*common, *args, f"data.path={corpus[PATHS[name]]}"] for name, args in LAYOUTS.items()}
    chat = ["data.kind=jsonl", "data.format=chat", "data.document_mask=true", f"data.path={corpus['chat']}"]
    out.update({name: [*common, *args, *chat] for name, args in CHAT_LAYOUTS.items()})
    return out


@pytest.fixture(scope="session")
def layout_run(reference_run, data_args):
    return lambda name: reference_run(*data_args[name])


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def by_step(run_dir: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in rows(run_dir) if key in r}


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "single_jsonl"])
def test_every_layout_and_source_gives_the_same_losses(layout_run, name: str) -> None:
    ref, run = layout_run("single_jsonl"), layout_run(name)
    ref_val, val = by_step(ref, "val_loss"), by_step(run, "val_loss")
    assert sorted(val) == EVAL_STEPS, f"evaluations at {sorted(val)}"
    for step in EVAL_STEPS:
        assert abs(val[step] - ref_val[step]) < TOL, (name, step, val[step], ref_val[step])
    ref_loss, loss = by_step(ref, "loss"), by_step(run, "loss")
    assert all(abs(loss[s] - ref_loss[s]) < TOL for s in range(1, STEPS + 1)), (loss, ref_loss)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["val_loss"] == pytest.approx(val[STEPS]) and summary["val_ppl"] > 1


@pytest.mark.parametrize("name", ["fsdp_chat", "tp_chat"])
def test_chat_data_gives_the_same_losses_in_every_layout(layout_run, name: str) -> None:
    ref, run = layout_run("single_chat"), layout_run(name)
    for key in ("loss", "val_loss"):
        a, b = by_step(ref, key), by_step(run, key)
        assert sorted(a) == sorted(b) and all(abs(a[s] - b[s]) < TOL for s in a), (key, a, b)
    meta = json.loads((Path(json.loads((run / "data_sources.json").read_text())["train"]) / "meta.json").read_text())
    assert meta["masks"], "chat data carries a loss mask"


# Every plain source (jsonl, parquet, hf) becomes the same cached token shards before training, so one
# of them covers their resume path; chat data adds loss-mask shards and the masked loss, here under TP.
@pytest.mark.parametrize("name", ["fsdp_hf_saved", "tp_chat"])
def test_kill_and_resume_with_evaluation_is_bit_identical(
    trainer, layout_run, data_args, tmp_path: Path, name: str
) -> None:
    run_dir = tmp_path / "run"
    args = [*data_args[name], "debug.fail_at_step=5", "debug.fail_mode=sigkill", "launch.max_restarts=1"]
    proc = trainer.cli(["train", *args, f"run.dir={run_dir}"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "resumed from step-00000004" in proc.stdout + proc.stderr
    ref = layout_run(name)
    for key in ("loss", "val_loss", "grad_norm"):
        assert by_step(run_dir, key) == by_step(ref, key), key  # the latest line per step: exact


def test_second_start_reuses_the_token_cache(layout_run, data_args) -> None:
    run_dir = layout_run("single_jsonl")
    entry = Path(json.loads((run_dir / "data_sources.json").read_text())["train"])
    built = (entry / "meta.json").stat().st_mtime_ns
    for name in LAYOUTS:
        layout_run(name)
    # Every run on the JSONL file (and the resume test's restarts) used the one entry built first.
    assert (entry / "meta.json").stat().st_mtime_ns == built
    assert json.loads((layout_run("pp_jsonl") / "data_sources.json").read_text())["train"] == str(entry)
    entries = {json.loads((layout_run(n) / "data_sources.json").read_text())["train"] for n in LAYOUTS}
    assert len(entries) == 4, "one entry per distinct source"


def _wandb_records(run_dir: Path) -> list:
    """The records of the offline run's .wandb file, decoded with wandb's own protobuf schema. The file is
    a LevelDB-style log (a 7-byte W&B header, then 32 KiB blocks of [crc32, length, type] + payload)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, out, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last fragment of one
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def test_trackers_hold_config_and_every_metric(layout_run) -> None:
    from mlflow.tracking import MlflowClient

    run_dir = layout_run("tp_hf_files")
    logged = rows(run_dir)
    assert (run_dir / "loss.png").is_file() and any((run_dir / "tb").iterdir())
    # MLflow: parameters = the resolved config, a metric history per key, the summary as tags.
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlruns' / 'mlflow.db'}")
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    run = client.get_run(run_id)
    assert run.info.run_name == run_dir.name and run.info.status == "FINISHED"
    assert run.data.params["model.dim"] == "64" and run.data.params["data.kind"] == "hf"
    for key in ("loss", "lr", "grad_norm", "val_loss", "val_ppl"):
        history = {m.step: m.value for m in client.get_metric_history(run_id, key)}
        assert history == pytest.approx({r["step"]: r[key] for r in logged if key in r}), key
    assert json.loads(run.data.tags["summary.val_loss"]) == pytest.approx(logged[-1]["val_loss"])
    # W&B offline: the run record holds the config and the name, history records every step's metrics.
    records = _wandb_records(run_dir)
    (run_rec,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run_rec.display_name == run_dir.name
    config = {u.key: json.loads(u.value_json) for u in run_rec.config.update}
    assert config["model"]["dim"] == 64 and config["data"]["kind"] == "hf"
    history = [
        {
            "step": r.history.step.num,
            **{i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in r.history.item},
        }
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert [h["step"] for h in history] == [r["step"] for r in logged]
    for h, r in zip(history, logged, strict=True):
        for key in ("loss", "grad_norm", "val_loss"):
            if key in r:
                assert h[key] == pytest.approx(r[key]), (key, r["step"])


def test_hf_export_carries_the_tokenizer(layout_run, tiny_tokenizer, tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from dtlaunch.convert.export import export_checkpoint

    export_checkpoint(layout_run("single_jsonl"), "hf", tmp_path / "export")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "export"))
    text = "kaka lolo mizo"
    assert tok(text)["input_ids"] == Tokenizer.from_file(str(tiny_tokenizer / "tokenizer.json")).encode(text).ids
    assert tok.eos_token == "<|endoftext|>" and tok.chat_template
