"""Shared fixtures: run `dtlaunch` as a user does (a process of its own: tests/cli_server.py) into a temporary run directory."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

# No test reaches the Hugging Face Hub (the test machines have no route to it). Three test modules used to set
# these at import, which made the whole session offline only when they were collected; set here, a test run
# alone behaves as it does in the whole suite.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    from durations_report import add_options

    add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    """`--durations-file` (make test): every test's time, stored and summarised by the session's controller
    (pytest-xdist workers report to it; they write nothing themselves).

    An xdist worker gets its share of the cores for torch's intra-op threads: by default each of the
    `make test` unit layer's 2 workers ran 2 threads on 2 cores, and the spinning, oversubscribed threads
    cost the real-tensor traces 2-3x their CPU seconds (test_plan_peft's head-unit trace: 14.2 CPU s with
    2 threads, 5.4 with 1, same result; issue #49). Processes the tests start inherit the variable."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if hasattr(config, "workerinput") and workers > 0 and "OMP_NUM_THREADS" not in os.environ:
        threads = str(max(1, (os.cpu_count() or 1) // workers))
        os.environ["OMP_NUM_THREADS"] = threads
        import sys

        if "torch" in sys.modules:  # imported before this hook (a plugin): the variable is read at import
            sys.modules["torch"].set_num_threads(int(threads))
    path = config.getoption("durations_file")
    if path and not hasattr(config, "workerinput"):
        from durations_report import DurationsPlugin

        config.pluginmanager.register(DurationsPlugin(config, Path(path)), "dtlaunch-durations")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`make test TEST_WORKERS=N` runs N pytest-xdist workers (`--dist loadgroup`). Each test file is one
    unit of work there, so its module-scoped fixtures (a forked layout sweep, a run its tests share) are built once,
    on one worker; the files that use the session's real Slurm cluster are one unit, so that only one
    worker starts Slurm."""
    for item in items:
        group = "slurm" if "slurm_cluster" in getattr(item, "fixturenames", ()) else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))


class Trainer:
    """`dtlaunch train` through the real CLI, with small fast defaults, and readers for its outputs."""

    # A few steps of the tiny model on synthetic data, no checkpoints, one thread per worker.
    FAST = [
        "training.steps=5",
        "training.seq_len=32",
        "optim.warmup_steps=2",
        "optim.lr=1e-2",
        "checkpoint.enabled=false",
        "data=synthetic",
        "launch.threads_per_worker=1",
        # loss.png costs ~1 s per run (matplotlib); test_run_dir_contents turns it back on.
        "training.loss_plot=false",
        # TensorBoard (the default tracker) costs rank 0 0.5-1 s of imports per run; metrics.jsonl, which
        # the tests read, is always written. test_run_dir_contents turns it back on.
        "logging.trackers=[]",
    ]

    @staticmethod
    def cli(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
        """`python -m dtlaunch ARGS`, started as a fork of a process that has imported torch (cli_server.py)."""
        from cli_server import run_dtlaunch

        env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
        return run_dtlaunch(args, env=env, timeout=timeout)

    def run(self, run_dir: Path, *overrides: str, expect_ok: bool = True) -> subprocess.CompletedProcess:
        proc = self.cli(["train", *self.FAST, *overrides, f"run.dir={run_dir}"])
        if expect_ok and proc.returncode != 0:
            pytest.fail(
                f"dtlaunch train {' '.join(overrides)} failed (rc {proc.returncode}):\n"
                f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
            )
        return proc

    @staticmethod
    def metrics(run_dir: Path) -> list[dict]:
        path = Path(run_dir) / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def losses(self, run_dir: Path) -> list[float]:
        return [m["loss"] for m in self.metrics(run_dir)]


@pytest.fixture(scope="session")
def trainer() -> Trainer:
    return Trainer()


@pytest.fixture(scope="session")
def reference_run(trainer: Trainer, tmp_path_factory: pytest.TempPathFactory):
    """The run directory of an uninterrupted `dtlaunch train <args>`, run once per session for each
    distinct argument list: the runs interrupted, restarted or resumed runs are compared with."""
    cache: dict[tuple[str, ...], Path] = {}

    def get(*args: str) -> Path:
        if args not in cache:
            run_dir = tmp_path_factory.mktemp("reference")
            # No tracker (TensorBoard's imports) unless the test's own arguments, which come later, ask.
            proc = trainer.cli(["train", "logging.trackers=[]", *args, f"run.dir={run_dir}"])
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
            cache[args] = run_dir
        return cache[args]

    return get


# The Gated DeltaNet hybrids' block kinds and widths: a linear block (2 key heads serving 4 value heads, key and
# value widths that differ) then a gated full-attention block.
GATED_DELTANET = {
    "head_dim": 16,
    "layer_types": ["linear_attention", "full_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
}
# Qwen3.5's: the same blocks with its (multimodal) RoPE.
QWEN3_5_LINEAR = {
    **GATED_DELTANET,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
}
# Tiny random-weight Hugging Face directories, one per native family (transformers' own config
# classes and save_pretrained), with a word-level tokenizer.json from the `tokenizers` package.
TINY_HF = {
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}),
    "qwen3": ("Qwen3Config", {"head_dim": 24, "tie_word_embeddings": False}),  # 4 x 24 != hidden 64
    "mistral": ("MistralConfig", {"sliding_window": 8, "tie_word_embeddings": False}),
    "llama_tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    # Two layers: a NoPE layer every second one (layer 1), so both kinds of attention are exercised.
    "smollm3": ("SmolLM3Config", {"no_rope_layer_interval": 2, "pad_token_id": None, "bos_token_id": None}),
    # A sliding layer (window 8, shorter than the tests' sequences) then a full one; post-norm blocks.
    "olmo3": (
        "Olmo3Config",
        {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    # Gemma 3: a sliding layer (window 8, local RoPE base 1e4) then a full one (base 1e6, linear scaling 2);
    # attention scale 1/sqrt(256) with head_dim 16. Untied, so pipeline layouts can hold it.
    "gemma3": (
        "Gemma3TextConfig",
        {
            "head_dim": 16,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
            "tie_word_embeddings": False,
        },
    ),
    # Qwen3.5 dense (Qwen3_5ForCausalLM): a Gated DeltaNet block with split input projections (2 key heads
    # serving 4 value heads) then a gated full-attention block, RoPE over 8 of 16 dims in three interleaved
    # multimodal sections (text: all the same positions), a SwiGLU MLP in each.
    "qwen3_5": ("Qwen3_5TextConfig", {**QWEN3_5_LINEAR, "tie_word_embeddings": False}),
}
TINY_HF_WORDS = [f"w{i}" for i in range(250)]
# The shape every tiny HF test model shares (2 layers, GQA 4/2 heads, 256-token vocabulary).
TINY_HF_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
}


@pytest.fixture(scope="session")
def tiny_hf_shape() -> dict:
    """TINY_HF_SHAPE for test modules: `from conftest import ...` is ambiguous once tests/system/conftest.py
    has been imported under the same module name, so tests take the shape through this fixture."""
    return dict(TINY_HF_SHAPE)


def _tiny_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(TINY_HF_WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


def _save_tiny_hf_dirs(base: Path, families: dict, seed: int, **common: Any) -> dict[str, Path]:
    """One random-weight directory (weights, config.json, tokenizer) per family, from transformers'
    config classes. Every parameter is perturbed so biases, norm gains and routers are visibly non-trivial."""
    transformers = pytest.importorskip("transformers")
    import torch

    out = {}
    for i, (family, (cls_name, extra)) in enumerate(families.items()):
        config = getattr(transformers, cls_name)(
            **{**TINY_HF_SHAPE, **extra}, rms_norm_eps=1e-6, eos_token_id=1, **common
        )
        torch.manual_seed(seed + i)
        model = transformers.AutoModelForCausalLM.from_config(config).float()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):  # GLM-4.5's router bias: chooses other experts
                    b.add_(torch.randn_like(b) * 0.2)
        path = base / family
        model.save_pretrained(path)
        _tiny_tokenizer(path)
        out[family] = path
    return out


@pytest.fixture(scope="session")
def tiny_hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _save_tiny_hf_dirs(tmp_path_factory.mktemp("tiny_hf"), TINY_HF, seed=100)


# Tiny mixture-of-experts directories: Qwen3-MoE with one dense (mlp_only) block and top-k weights left
# unnormalised, Mixtral with its renormalised top-2 of 4 experts, GLM-4.5 with every routing part, gpt-oss
# with its sinks and biases, DeepSeek-V3 with GLM-4.5's routing and its latent attention, Qwen3-Next with its
# linear and gated full attention.
TINY_HF_MOE = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "head_dim": 24,
            "moe_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "mlp_only_layers": [1],
        },
    ),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # GLM-4.5: a dense first block, 8 experts in 2 groups (1 kept), a shared expert, scaled weights, q/k/v
    # biases, q/k norm, and RoPE over 12 of 24 dims per head.
    "glm4_moe": (
        "Glm4MoeConfig",
        {
            "head_dim": 24,
            "moe_intermediate_size": 32,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_group": 2,
            "topk_group": 1,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5,
            "attention_bias": True,
            "use_qk_norm": True,
        },
    ),
    # gpt-oss: a sliding layer (window 8) then a full one, YaRN over an original context of 16, and a SwiGLU
    # clamp of 0.5 that the tiny activations reach (the published 7.0 would never clip here).
    "gpt_oss": (
        "GptOssConfig",
        {
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 8,
            "swiglu_limit": 0.5,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1e4,
                "factor": 8.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    # DeepSeek-V3: GLM-4.5's routing and latent attention (low-rank q, a 16-wide kv latent, 8 rotated dims
    # per head, interleaved as DeepSeek's checkpoints) with widths that all differ, 4 kv heads as MLA has.
    "deepseek_v3": (
        "DeepseekV3Config",
        {
            "num_key_value_heads": 4,
            "moe_intermediate_size": 32,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_group": 2,
            "topk_group": 1,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5,
            "q_lora_rank": 24,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 12,
            "v_head_dim": 10,
        },
    ),
    # Qwen3-Next: a Gated DeltaNet block (2 key heads serving 4 value heads, key and value widths that
    # differ) then a gated full-attention block (RoPE over 4 of 16 dims), 4 experts and the gated shared one.
    "qwen3_next": (
        "Qwen3NextConfig",
        {
            **GATED_DELTANET,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
        },
    ),
    # Qwen3.5-MoE (Qwen3_5MoeForCausalLM): qwen3_5's blocks with Qwen3-Next's 4 experts and gated shared one.
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        {
            **QWEN3_5_LINEAR,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
        },
    ),
}


@pytest.fixture(scope="session")
def tiny_moe_hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _save_tiny_hf_dirs(tmp_path_factory.mktemp("tiny_hf_moe"), TINY_HF_MOE, seed=200, tie_word_embeddings=False)


# Words of the tiny test tokenizer and corpora: syllable pairs, a few hundred distinct words.
_SYLLABLES = ["ka", "lo", "mi", "nu", "pe", "ra", "si", "to", "ve", "zo", "ba", "du", "fe", "gi", "ho", "ju", "ly"]
TINY_WORDS = [a + b for a in _SYLLABLES for b in _SYLLABLES]
TINY_SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_documents(n: int, seed: int = 0, words: tuple[int, int] = (20, 60)) -> list[str]:
    """n documents of random tiny-vocabulary words (deterministic per seed)."""
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(TINY_WORDS) for _ in range(rng.randint(*words))) for _ in range(n)]


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with a WordLevel tokenizer.json over TINY_WORDS (+ specials) and a tokenizer_config.json
    with a ChatML chat template, built with the `tokenizers` package (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(TINY_SPECIALS + TINY_WORDS + ["user", "assistant", "system", ":"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(TINY_SPECIALS)
    out = tmp_path_factory.mktemp("tiny_tokenizer")
    tok.save(str(out / "tokenizer.json"))
    chat = (
        "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
        "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
    )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "unk_token": "<unk>",
        "chat_template": chat,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return out


@pytest.fixture(scope="session")
def tiny_docs():
    """tiny_documents, for test modules (conftest is not importable as a module under every import mode)."""
    return tiny_documents


@pytest.fixture(scope="session")
def tiny_eval_inputs(tmp_path_factory: pytest.TempPathFactory, tiny_hf_dirs) -> tuple[list[str], Path]:
    """For training.eval_tasks in a job: overrides (a tiny HF Llama with its tokenizer, JSONL data over its
    words, training.eval_include) and the directory holding `tiny_mc`, a multiple-choice lm-eval task over
    local JSONL (offline: lm-eval's built-in tasks download)."""
    import random

    model = tiny_hf_dirs["llama_tied"]
    rng = random.Random(0)
    docs = [" ".join(rng.choice(TINY_HF_WORDS) for _ in range(rng.randint(20, 40))) for _ in range(60)]
    base = tmp_path_factory.mktemp("eval_inputs")
    (base / "data.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tasks = base / "tasks"
    tasks.mkdir()
    rows = []
    for doc in docs[:12]:
        w = doc.split()[:6]
        choices = [" ".join(rng.sample(w, len(w))) for _ in range(2)] + [" ".join(w)]
        rng.shuffle(choices)
        rows.append({"question": f"{w[0]} {w[1]}", "choices": choices, "answer": choices.index(" ".join(w))})
    (tasks / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tasks / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\ndataset_path: json\ntest_split: test\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tasks / 'mc.jsonl'}\noutput_type: multiple_choice\ndoc_to_text: '{{{{question}}}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n"
    )
    overrides = [
        f"model.init_from=hf:{model}",
        "data.kind=jsonl",
        f"data.path={base / 'data.jsonl'}",
        f"data.cache_dir={base / 'cache'}",
        "training.seq_len=32",
        "training.loss_plot=false",
        f"training.eval_include={tasks}",
    ]
    return overrides, tasks


@pytest.fixture(scope="session")
def write_pairs():
    """`write(out, n, seed)`: n random preference pairs as JSONL (prompt, chosen, rejected: words w0..w249)."""
    import json
    import random

    def write(out: Path, n: int, seed: int) -> Path:
        rng = random.Random(seed)

        def words(lo: int, hi: int) -> str:
            return " ".join(f"w{rng.randint(0, 249)}" for _ in range(rng.randint(lo, hi)))

        rows = [{"prompt": words(3, 12), "chosen": words(2, 8), "rejected": words(2, 8)} for _ in range(n)]
        out.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return out

    return write
