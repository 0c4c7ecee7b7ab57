"""objective=kto's data (data.format=unpaired) and rules: each example's KL row as TRL's KTOTrainer builds it
(its own `_prepare_dataset`), the cached rows and labels the worker's loader hands, bad records named by file
and line, the combinations validate refuses (exit 2), and the plan: the same rows and reference as DPO's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dtlaunch.data.unpaired import UnpairedSource, example_rows
from dtlaunch.errors import ConfigError, InputError
from dtlaunch.job.compose import compose
from dtlaunch.job.validate import validate
from dtlaunch.launch.run_data import tokenize_records

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")


def write(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def args(tok: Path, data: Path, cache: Path, *extra: str) -> list[str]:
    return [
        "objective=kto",
        "data.kind=jsonl",
        "data.format=unpaired",
        f"data.path={data}",
        f"data.tokenizer={tok / 'tokenizer.json'}",
        f"data.cache_dir={cache}",
        "model.vocab_size=512",
        "training.seq_len=12",
        "training.micro_batch=3",
        *extra,
    ]


RECORDS = [
    {"prompt": "kaka kalo", "completion": " lolo lomi", "label": True},
    {"prompt": "kami", "completion": " nunu", "label": False},
    {"prompt": "kape kara kasi", "completion": " mimi", "label": True},
    {"prompt": "pepe", "completion": " rara rasi rato", "label": True},
    {"prompt": "sisi", "completion": " toto", "label": False},
]


def source_of(tiny_tokenizer: Path, tmp_path: Path, records: list, *extra: str) -> UnpairedSource:
    cfg = compose(args(tiny_tokenizer, write(tmp_path / "u.jsonl", records), tmp_path / "cache", *extra)).cfg
    validate(cfg)
    entry = tokenize_records(cfg, str(cfg.data.path), "data.path")
    return UnpairedSource(str(entry), int(cfg.training.seq_len), "data.path")


def test_kl_rows_are_trls(tiny_tokenizer: Path, tiny_hf_dirs: dict, tmp_path: Path) -> None:
    """TRL's KTOTrainer prepares 7 records with per_device_train_batch_size=3 (runs of 3, 3, 1): each KL row
    is the example's prompt + TRL's KL_completion_ids; example_rows builds the same from the same ids."""
    datasets, trl, transformers = (pytest.importorskip(m) for m in ("datasets", "trl", "transformers"))
    import torch

    hf = tiny_hf_dirs["llama_tied"]  # a model for the trainer; no forward runs
    records = RECORDS + RECORDS[:2]
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tiny_tokenizer / "tokenizer.json"), eos_token="<|endoftext|>", pad_token="<unk>"
    )
    config = trl.KTOConfig(
        output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, bf16=False, per_device_train_batch_size=3
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    prepared = trl.KTOTrainer(
        model=model, args=config, train_dataset=datasets.Dataset.from_list(records), processing_class=tok
    ).train_dataset
    examples = [(r["prompt_ids"] + r["completion_ids"], len(r["prompt_ids"]), r["label"]) for r in prepared]
    labels: list = []
    rows = list(example_rows(examples, 3, labels))
    assert labels == [r["label"] for r in records]
    assert [ids for ids, _ in rows[0::2]] == [ids for ids, _, _ in examples]
    assert [ids for ids, _ in rows[1::2]] == [r["prompt_ids"] + r["KL_completion_ids"] for r in prepared]
    assert rows[-1][0] == examples[-1][0]  # a run of one: its KL row is its own (TRL's too)


def test_cached_rows_labels_and_the_loader(tiny_tokenizer: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    from dtlaunch.train.data import TokenLoader

    source = source_of(tiny_tokenizer, tmp_path, RECORDS)
    assert source.num_samples == 5
    assert source.labels([4, 0, 1]).tolist() == [False, True, False]
    enc = Tokenizer.from_file(str(tiny_tokenizer / "tokenizer.json"))
    eos = enc.token_to_id("<|endoftext|>")

    def ids(text: str) -> list[int]:
        return enc.encode(text, add_special_tokens=False).ids

    sample = source.sample(1)  # the second of the run of 3: its KL row takes the first's completion
    own, kl = ids("kami nunu") + [eos], ids("kami lolo lomi") + [eos]
    assert sample[0, 0, : len(own)].tolist() == own and sample[1, 0, : len(kl)].tolist() == kl
    assert sample[0, 1].tolist() == [0] + [1, 1] + [0] * 10 and sample[1, 1].tolist() == [0] + [1] * 3 + [0] * 9
    assert source.sample(3)[1, 0, :3].tolist() == ids("pepe toto") + [eos]  # runs restart: 3 takes 4's

    loader = TokenLoader(source, 2, 12, 0, 0, 1, 512, global_batch=2)
    batch = loader.next_batch()
    assert batch.inputs.shape == (4, 12)  # 2 own rows, then their 2 KL rows
    assert batch.labels.tolist() == source.labels(list(batch.indices)).tolist()


def test_a_bad_record_is_named_by_file_and_line(tiny_tokenizer: Path, tmp_path: Path) -> None:
    bad = {"prompt": "kaka", "completion": "lolo", "label": "yes"}
    with pytest.raises(InputError, match=r"u\.jsonl:2 is 'yes', not true / false"):
        source_of(tiny_tokenizer, tmp_path, [RECORDS[0], bad])
    with pytest.raises(InputError, match=r"u\.jsonl:1 has no field 'label'"):
        source_of(tiny_tokenizer, tmp_path, [{"prompt": "kaka", "completion": "lolo"}])
    mixed = {"prompt": "kaka", "completion": [{"role": "assistant", "content": "lolo"}], "label": True}
    with pytest.raises(InputError, match=r"u\.jsonl:3 mixes field types"):
        source_of(tiny_tokenizer, tmp_path, [*RECORDS[:2], mixed])


@pytest.mark.parametrize(
    "extra, message",
    [
        (["data.format=preference"], "objective=kto trains on unpaired completions, not data.format=preference"),
        (["objective=dpo"], "data.format=unpaired holds labelled single completions, which objective=dpo cannot"),
        (["objective.loss=sigmoid"], "objective.loss=sigmoid is not a KTO loss"),
        (["objective=dpo", "data.format=preference", "objective.loss=kto"], "objective.loss=kto is objective=kto's"),
        (["training.micro_batch=1"], "training.micro_batch=1: objective.loss=kto estimates its KL term"),
        (
            ["strategy=pp", "launch.nproc_per_node=2", "model=tiny_deep", "training.micro_batch=4"],
            "objective=kto does not run under pipeline",
        ),
        (["data.val_fraction=0.5"], "validation is not computed for objective=kto yet"),
        (["objective.sft_weight=0.5"], "objective.sft_weight=0.5 is DPO's NLL term"),
        (["objective.undesirable_weight=-1"], "objective.undesirable_weight=-1.0 is out of range"),
    ],
)
def test_validate_refuses(tiny_tokenizer: Path, tmp_path: Path, extra: list[str], message: str) -> None:
    data = write(tmp_path / "u.jsonl", RECORDS)
    with pytest.raises(ConfigError) as err:
        validate(compose(args(tiny_tokenizer, data, tmp_path, *extra)).cfg)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "extra",
    [
        ["objective.loss=apo_zero_unpaired", "training.micro_batch=1"],
        ["strategy.cp=2", "launch.nproc_per_node=2", "training.seq_len=16", "objective.precompute_reference=true"],
        ["peft=lora", "strategy=zero3", "launch.nproc_per_node=2"],
    ],
    ids=["apo-mb1", "cp-precomputed", "lora-zero3"],
)
def test_validate_accepts(tiny_tokenizer: Path, tmp_path: Path, extra: list[str]) -> None:
    data = write(tmp_path / "u.jsonl", RECORDS)
    validate(compose(args(tiny_tokenizer, data, tmp_path, *extra)).cfg)


@pytest.mark.parametrize("extra", [["strategy=zero3"], ["strategy=ddp", "peft=lora"]])
def test_the_plan_is_dpos(extra: list[str]) -> None:
    """An example and its KL row are two rows through the policy and the reference, as a DPO pair: the
    planner gives both objectives the same phases and lines (the reference copy, or none with LoRA)."""
    from dtlaunch.commands.common import load_job
    from dtlaunch.plan.memory import plan_memory
    from dtlaunch.plan.objective import PHASE_REFERENCE

    common = ["model=planner7m", "training.micro_batch=4", "training.seq_len=128", "launch.nproc_per_node=2"]
    kto, dpo, sft = (
        plan_memory(job.cfg, job.layout).worst
        for job in (load_job([*common, *extra, f"objective={o}"]) for o in ("kto", "dpo", "sft"))
    )
    assert PHASE_REFERENCE in kto.phases and kto.phases == dpo.phases and kto.lines == dpo.lines
    assert kto.phases["forward"] > sft.phases["forward"]  # the KL rows: twice the rows
