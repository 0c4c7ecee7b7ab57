"""`dtlaunch eval`: lm-evaluation-harness on dtlaunch's own model gives what lm-eval's own HFLM gives on the
model `ckpt export --format hf` writes (the same accuracy, per-sample loglikelihoods within 1e-5), for an
hf:DIR source, a run, and a run trained from scratch on the byte tokenizer; bad inputs are one line and exit 2.

Offline: the tasks are YAML files of our own over local JSONL (lm-eval's built-in tasks download)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_server import run_dtlaunch

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
pytest.importorskip("lm_eval")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TASKS = ["tiny_mc", "tiny_rolling", "tiny_gen"]


def dtlaunch(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = run_dtlaunch([*args], env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_docs, tiny_hf_shape) -> Path:
    """A tiny Llama with a byte-level BPE tokenizer trained on the corpus and a ChatML-like chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(tiny_docs(100, seed=1), trainer=trainer)
    path = tmp_path_factory.mktemp("eval_llama")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", chat_template=CHAT)
    fast.save_pretrained(path)
    shape = {**tiny_hf_shape, "vocab_size": tok.get_vocab_size()}
    config = transformers.LlamaConfig(**shape, eos_token_id=fast.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():  # visible, non-uniform preferences between the choices
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory, tiny_docs) -> Path:
    """Three task YAMLs over local JSONL: multiple choice, rolling loglikelihood (perplexity), generation."""
    d = tmp_path_factory.mktemp("tasks")
    rng = random.Random(3)
    docs = tiny_docs(40, seed=4, words=(4, 9))
    mc = []
    for i, doc in enumerate(docs[:30]):
        words = doc.split()
        choices = [" ".join(rng.sample(words, len(words))) for _ in range(3)] + [doc]
        rng.shuffle(choices)
        mc.append({"question": f"q{i}: {words[0]} {words[1]}", "choices": choices, "answer": choices.index(doc)})
    rows = {
        "mc": mc,
        "rolling": [{"text": t} for t in docs[30:36]],
        "gen": [{"prompt": " ".join(t.split()[:3]), "target": t.split()[3]} for t in docs[36:40]],
    }
    for name, data in rows.items():
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    common = "dataset_path: json\ntest_split: test\n"

    def files(name: str) -> str:
        return f"dataset_kwargs:\n  data_files:\n    test: {d / name}.jsonl\n"

    (d / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\n{common}{files('mc')}output_type: multiple_choice\ndoc_to_text: '{{{{question}}}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (d / "tiny_rolling.yaml").write_text(
        f"task: tiny_rolling\n{common}{files('rolling')}output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
        "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n"
    )
    (d / "tiny_gen.yaml").write_text(
        f"task: tiny_gen\n{common}{files('gen')}output_type: generate_until\ndoc_to_text: '{{{{prompt}}}}'\n"
        "doc_to_target: '{{target}}'\ngeneration_kwargs:\n  until: ['\\n']\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    # lm-eval's built-in tasks read hub datasets (arc_easy: allenai/ai2_arc); this one's is in no cache.
    (d / "tiny_hub.yaml").write_text(
        "task: tiny_hub\ndataset_path: dtlaunch-tests/no-such-dataset\ntest_split: test\noutput_type: loglikelihood\n"
        "doc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"
    )
    return d


@pytest.fixture(scope="module")
def manager(tasks_dir: Path) -> Any:
    from dtlaunch.infer.harness import task_manager

    return task_manager(str(tasks_dir.resolve()))  # the one the in-process commands below use too


def run_both(
    ours: Any, reference_dir: Path, manager: Any, tasks: list[str], dtype: str, chat: bool = False, limit: int = 0
) -> tuple[dict, dict]:
    """simple_evaluate with samples on dtlaunch's LM and on lm-eval's HFLM over a Hugging Face directory."""
    from lm_eval.models.huggingface import HFLM

    from dtlaunch.infer.harness import EvalRequest, evaluate

    req = EvalRequest(tasks=tasks, batch_size=4, apply_chat_template=chat, limit=limit)
    reference = HFLM(pretrained=str(reference_dir), device="cpu", batch_size=4, dtype=dtype)
    return evaluate(ours, req, manager, log_samples=True), evaluate(reference, req, manager, log_samples=True)


def assert_same(ours: dict, ref: dict) -> None:
    """The same metrics and, sample by sample, the same text / loglikelihoods within 1e-5 (both sides in
    float64 weights: in float32 the sums of ~100 nats differ by a few float32 rounding steps, ~2e-5)."""
    for task in ref["results"]:
        for key, value in ref["results"][task].items():
            if isinstance(value, float) and "stderr" not in key:
                assert ours["results"][task][key] == pytest.approx(value, rel=1e-6), (task, key)
        mine = {s["doc_id"]: s for s in ours["samples"][task]}
        assert len(mine) == len(ref["samples"][task]) > 0
        for s in ref["samples"][task]:
            got, want = mine[s["doc_id"]]["resps"], s["resps"]
            assert len(got) == len(want)
            for g, w in zip(got, want, strict=True):
                g, w = g[0], w[0]
                if isinstance(w, str):  # generate_until: the same text
                    assert g == w
                elif isinstance(w, (list, tuple)):  # loglikelihood: (logprob, is_greedy)
                    assert abs(g[0] - w[0]) < 1e-5 and g[1] == w[1], (g, w)
                else:  # loglikelihood_rolling: the summed logprob
                    assert abs(g - w) < 1e-5, (g, w)


def float64(lm: Any) -> Any:
    lm._model.double()
    return lm


def test_hf_source_matches_hflm_with_and_without_chat_template(model_dir: Path, manager: Any) -> None:
    from dtlaunch.infer.lm_eval_adapter import load_lm

    ours = float64(load_lm(f"hf:{model_dir}", torch.device("cpu"), batch_size=4))
    mine, ref = run_both(ours, model_dir, manager, TASKS, "float64")
    assert_same(mine, ref)
    # The tiny model is random: the accuracy is a number between chance and 1 that both sides agree on.
    assert 0 < ref["results"]["tiny_mc"]["acc,none"] < 1
    assert ref["samples"]["tiny_gen"][0]["resps"][0][0]  # something was generated
    chat_mine, chat_ref = run_both(ours, model_dir, manager, ["tiny_mc"], "float64", chat=True, limit=8)
    assert_same(chat_mine, chat_ref)
    rendered = chat_ref["samples"]["tiny_mc"][0]["arguments"][0][0]
    assert rendered.startswith("<|im_start|>user\n"), rendered


@pytest.fixture(scope="module")
def run(model_dir: Path, tasks_dir: Path, tmp_path_factory, tiny_docs) -> Path:
    """A few steps of fine-tuning the tiny model on its own tokenizer, with training.eval_tasks set."""
    base = tmp_path_factory.mktemp("eval_run")
    data = base / "mine.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in tiny_docs(100, seed=2)))
    run = base / "run"
    args = [f"model.init_from=hf:{model_dir}", "data.kind=jsonl", f"data.path={data}", f"data.cache_dir={base}/cache"]
    short = ["training.steps=3", "training.seq_len=32", "checkpoint.every_steps=3", "optim.lr=1e-2"]
    one = ["launch.nproc_per_node=1", "launch.threads_per_worker=1", "training.loss_plot=false", "logging.trackers=[]"]
    ev = ["training.eval_tasks=[tiny_mc,tiny_rolling]", f"training.eval_include={tasks_dir}"]
    proc = dtlaunch("train", "recipe=tiny_fsdp", *args, *short, *one, *ev, f"run.dir={run}")
    assert "eval results:" in proc.stdout and "tiny_mc" in proc.stdout, proc.stdout[-2000:]
    return run


def test_run_evaluated_after_training_matches_hflm_on_the_export(run: Path, manager: Any, tmp_path: Path) -> None:
    from dtlaunch.convert.export import export_checkpoint
    from dtlaunch.infer.lm_eval_adapter import load_lm

    export = tmp_path / "export"
    export_checkpoint(run, "hf", export)
    # Sample by sample (float64 on both sides) ...
    ours = float64(load_lm(str(run), torch.device("cpu"), batch_size=4))
    mine, ref = run_both(ours, export, manager, ["tiny_mc", "tiny_rolling"], "float64")
    assert_same(mine, ref)
    # ... and the file training.eval_tasks wrote (float32, as `dtlaunch eval` runs): the same scores.
    (saved,) = [json.loads(p.read_text()) for p in (run / "eval").glob("*.json")]
    assert saved["step"] == 3 and saved["request"]["tasks"] == ["tiny_mc", "tiny_rolling"]
    for key in ("acc,none", "acc_norm,none"):
        assert saved["results"]["tiny_mc"][key] == ref["results"]["tiny_mc"][key]
    for key in ("word_perplexity,none", "bits_per_byte,none"):
        assert saved["results"]["tiny_rolling"][key] == pytest.approx(ref["results"]["tiny_rolling"][key], rel=1e-5)
    # The run's report shows it.
    from dtlaunch.commands.report import report_command

    assert report_command(str(run), None) == 0
    page = (run / "report.html").read_text()
    assert "evaluation (lm-evaluation-harness)" in page and "tiny_mc" in page and "word_perplexity" in page


def test_cli_on_hf_source_writes_results_and_prints_a_table(
    model_dir: Path, tasks_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd
) -> None:
    # In-process through the console entry point (the training run above is the subprocess one).
    from dtlaunch.cli import run as cli_run

    out = tmp_path / "results"
    monkeypatch.setenv("COLUMNS", "250")
    monkeypatch.chdir(tmp_path)  # not a git repository: lm-eval's `git describe` there must stay quiet
    argv = ["eval", f"hf:{model_dir}", "--tasks", "tiny_mc,tiny_gen", "--include", str(tasks_dir), "--limit", "5"]
    more = ["--batch-size", "2", "--num-fewshot", "1", "--apply-chat-template", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["dtlaunch", *argv, *more])
    with pytest.raises(SystemExit) as exc:
        cli_run()
    stdout, stderr = capfd.readouterr()
    assert exc.value.code == 0, stdout[-2000:]
    assert "not a git repository" not in stderr, stderr
    (path,) = out.glob("*.json")
    saved = json.loads(path.read_text())
    assert saved["n_samples"]["tiny_mc"]["effective"] == 5 and saved["step"] is None
    assert saved["request"]["num_fewshot"] == 1 and saved["request"]["apply_chat_template"] is True
    acc = saved["results"]["tiny_mc"]["acc,none"]
    assert "tiny_gen" in stdout and f"{acc:.4f}" in stdout and str(path) in stdout


def one_line_exit_2(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == 2, proc.stdout[-1000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dtlaunch: error:"), proc.stderr
    assert all(w in lines[0] for w in words), lines[0]


def cli_error(argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> str:
    """In-process through the console entry point: exit 2 and one line on stderr, which is returned."""
    from dtlaunch.cli import run as cli_run

    monkeypatch.setattr(sys, "argv", ["dtlaunch", *argv])
    with pytest.raises(SystemExit) as exc:
        cli_run()
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert exc.value.code == 2 and len(lines) == 1 and lines[0].startswith("dtlaunch: error:"), lines
    return lines[0]


def test_bad_inputs_are_one_line(model_dir: Path, tasks_dir: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    hf, inc = f"hf:{model_dir}", ["--include", str(tasks_dir)]
    line = cli_error(["eval", hf, "--tasks", "tiny_mc,tiny_gn", *inc], monkeypatch, capsys)
    assert "unknown task 'tiny_gn'" in line and "tiny_gen" in line, line
    line = cli_error(["eval", hf, "--tasks", "tiny_mc", "--include", str(tmp_path / "no")], monkeypatch, capsys)
    assert "--include" in line and "no such directory" in line, line
    line = cli_error(["eval", str(tmp_path), "--tasks", "tiny_mc"], monkeypatch, capsys)
    assert "not a run, checkpoint or hf:DIR" in line, line
    assert "config.json" in cli_error(["eval", f"hf:{tmp_path}", "--tasks", "tiny_mc"], monkeypatch, capsys)
    assert "--tasks" in cli_error(["eval", hf, "--tasks", "tiny_mc,,x"], monkeypatch, capsys)
    assert "batch size 0" in cli_error(["eval", hf, "--tasks", "tiny_mc", "--batch-size", "0"], monkeypatch, capsys)
    # Offline, a task whose hub dataset is not cached: refused before the model loads, naming the task, the
    # dataset and the fix, instead of lm-eval's ConnectionError. (datasets reads HF_HUB_OFFLINE at its import,
    # which another test module may have done first: set as datasets then sees it.)
    monkeypatch.setattr("datasets.config.HF_HUB_OFFLINE", True)
    line = cli_error(["eval", hf, "--tasks", "tiny_mc,tiny_hub", *inc], monkeypatch, capsys)
    assert "task 'tiny_hub' reads the hub dataset dtlaunch-tests/no-such-dataset" in line, line
    assert "HF_HUB_OFFLINE=1" in line and "--include" in line, line


def test_without_lm_eval_one_line_names_the_extra(model_dir: Path) -> None:
    # A meta-path finder that refuses lm_eval: the interpreter behaves as if it were not installed.
    code = (
        "import sys\n"
        "class NoLmEval:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'lm_eval': raise ImportError('no lm_eval')\n"
        "sys.meta_path.insert(0, NoLmEval())\n"
        "sys.argv = ['dtlaunch', 'eval', sys.argv[1], '--tasks', 'tiny_mc']\n"
        "from dtlaunch.cli import run; run()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, f"hf:{model_dir}"], capture_output=True, text=True, timeout=120)
    one_line_exit_2(proc, "pip install 'dtlaunch[eval]'")


def test_hf_source_with_peft_adapter_matches_hflm_with_peft(model_dir: Path, manager: Any, tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    from dtlaunch.infer.lm_eval_adapter import load_lm

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(1)
    with torch.no_grad():  # B = 0 at initialisation: give the adapters an effect
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    adapter = tmp_path / "adapter"
    model.save_pretrained(adapter)
    from lm_eval.models.huggingface import HFLM

    from dtlaunch.infer.harness import EvalRequest, evaluate

    req = EvalRequest(tasks=["tiny_mc"], batch_size=4, limit=10)
    ours = float64(load_lm(f"hf:{model_dir}", torch.device("cpu"), batch_size=4, adapter=str(adapter)))
    ref = HFLM(pretrained=str(model_dir), peft=str(adapter), device="cpu", batch_size=4, dtype="float64")
    mine, theirs = evaluate(ours, req, manager, log_samples=True), evaluate(ref, req, manager, log_samples=True)
    assert_same(mine, theirs)
    name = "layers.0.attention.wq.weight"
    plain = dict(load_lm(f"hf:{model_dir}", torch.device("cpu"), batch_size=4)._model.named_parameters())[name]
    assert not torch.allclose(plain.double(), dict(ours._model.named_parameters())[name])  # the adapter is in


def test_bad_eval_task_in_training_is_refused_before_anything_starts(
    tasks_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import dtlaunch.launch.local as local

    def refuse(*_a: object, **_k: object) -> None:
        raise AssertionError("workers were launched")

    monkeypatch.setattr(local, "launch_local", refuse)
    run_dir = tmp_path / "run"
    ev = ["training.eval_tasks=[tiny_mc,tiny_mcc]", f"training.eval_include={tasks_dir}"]
    line = cli_error(["train", "recipe=tiny_ddp", *ev, f"run.dir={run_dir}"], monkeypatch, capsys)
    assert "training.eval_tasks: unknown task 'tiny_mcc'" in line and "tiny_mc" in line, line
    assert not run_dir.exists()


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory) -> Path:
    """A tiny model trained from scratch on the built-in byte tokenizer over a real text file, as the
    README's demo trains (data.kind=text, data.tokenizer=byte): two steps, one worker."""
    import textwrap

    base = tmp_path_factory.mktemp("byte_run")
    text = base / "textwrap.py"
    text.write_bytes(Path(textwrap.__file__).read_bytes())
    run = base / "run"
    data = ["data.kind=text", f"data.path={text}", "data.tokenizer=byte", f"data.cache_dir={base}/cache"]
    short = ["training.steps=2", "training.seq_len=32", "checkpoint.every_steps=2", "optim.lr=1e-2"]
    one = ["launch.nproc_per_node=1", "launch.threads_per_worker=1", "training.loss_plot=false", "logging.trackers=[]"]
    dtlaunch("train", "recipe=tiny_ddp", *data, *short, *one, f"run.dir={run}")
    return run


def test_byte_tokenizer_run_matches_hflm_on_the_export(
    byte_run: Path, tasks_dir: Path, manager: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from dtlaunch.cli import run as cli_run
    from dtlaunch.infer.lm_eval_adapter import load_lm

    # `dtlaunch eval CHECKPOINT` as a user runs it (float32) ...
    (ckpt,) = (byte_run / "checkpoints").glob("step-*")
    out = tmp_path / "results"
    argv = ["eval", str(ckpt), "--tasks", "tiny_mc", "--include", str(tasks_dir), "--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["dtlaunch", *argv, "--batch-size", "4"])
    with pytest.raises(SystemExit) as exc:
        cli_run()
    assert exc.value.code == 0, capsys.readouterr().out[-2000:]
    (saved,) = [json.loads(p.read_text()) for p in out.glob("*.json")]
    # ... the export is a Hugging Face directory whose AutoTokenizer gives the byte ids ...
    export = tmp_path / "export"
    argv = ["ckpt", "export", str(byte_run), "--format", "hf", "--out", str(export)]
    monkeypatch.setattr(sys, "argv", ["dtlaunch", *argv])
    with pytest.raises(SystemExit) as exc:
        cli_run()
    assert exc.value.code == 0, capsys.readouterr().out[-2000:]
    tok = transformers.AutoTokenizer.from_pretrained(str(export))
    assert tok.encode("héllo <eos>", add_special_tokens=False) == list("héllo <eos>".encode())
    assert (tok.bos_token_id, tok.eos_token_id) == (256, 257)
    # ... and lm-eval's HFLM on it agrees sample by sample (float64 on both sides) with the run.
    ours = float64(load_lm(str(byte_run), torch.device("cpu"), batch_size=4))
    mine, ref = run_both(ours, export, manager, TASKS, "float64")
    assert_same(mine, ref)
    assert 0 < ref["results"]["tiny_mc"]["acc,none"] < 1
    for key in ("acc,none", "acc_norm,none"):
        assert saved["results"]["tiny_mc"][key] == ref["results"]["tiny_mc"][key]
    # The byte tokenizer has no chat template: asking for one is one line.
    capsys.readouterr()  # what the commands above printed
    argv = ["eval", str(byte_run), "--tasks", "tiny_mc", "--include", str(tasks_dir), "--apply-chat-template"]
    line = cli_error(argv, monkeypatch, capsys)
    assert "--apply-chat-template" in line and "byte tokenizer" in line and "no chat template" in line, line
