"""The life-cycle matrix: every model family x every step of a model's life in dtlaunch, one test file.

A family joins by one line of FAMILIES (its tiny Hugging Face directory from tests/conftest.py, tied or not,
dense or MoE, the layouts it trains in, the steps it cannot do and why). The steps, each a test
parametrized over FAMILIES:

1. plan:      `dtlaunch plan model.init_from=hf:DIR` prints transformers' exact parameter count;
2. generate:  `dtlaunch generate hf:DIR --temperature 0` prints transformers' greedy tokens;
3. layouts:   the first losses of DDP(2), FSDP(2), TP(2) and, for MoE, EP(2) equal one process's within
              1e-4 (one group of 2 forked gloo workers for every family, tests/distributed/forked_training.py);
4. lora:      LoRA trains its adapters and nothing else (and, for the Gated DeltaNet hybrids, QLoRA on
              their NF4 base; the other families' QLoRA: test_qlora.py and the layout matrices);
5. resume:    a run SIGKILLed after its step-2 checkpoint and started again resumes bit for bit
              (test_resume_matrix.py's `start`, a world of one, the launcher's half in this process);
6. export:    `ckpt export --format hf` of that run loads in transformers with the run's logits (1e-4);
7. dpo, grpo: one DPO step and one GRPO step (its loss on a rollout's rows) run, with finite losses.

A cell a family cannot do is a one-line reason in CANNOT, and the product must refuse it with one line
(checked by test_refusals). The larger per-family layouts (ZeRO, HSDP, pipeline, 3D, bf16) stay in
test_family_layouts.py; the per-objective layouts in test_dpo_layouts.py / test_lora_layouts.py.
docs/models.md's "Families x life cycle" table is this table in prose (test_docs_table_matches).

In-process throughout: plan, generate and export through `cli.run` (tests/cli_in_process.py), training
through the runtime object or the worker's entry point in a forked child.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from forked_training import run_forked, train

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

DENSE = ("ddp", "fsdp", "tp")
MOE_LAYOUTS = ("ddp", "fsdp", "tp", "ep")
STEPS_ALL = ("plan", "generate", "layouts", "lora", "resume", "export", "dpo", "grpo")


@dataclass(frozen=True)
class Family:
    name: str
    hf_dir: str  # key of tiny_hf_dirs / tiny_moe_hf_dirs (tests/conftest.py)
    tied: bool
    moe: bool
    layouts: tuple[str, ...]
    overrides: tuple[str, ...] = ()
    lora: tuple[str, ...] = ("peft=lora",)
    # peft=qlora's overrides where the row runs QLoRA too (the `lora` step on an NF4 base); () where not.
    qlora: tuple[str, ...] = ()
    # step or layout -> (why, a fragment of the product's one-line refusal)
    cannot: dict = field(default_factory=dict)


_NO_EP_DENSE = ("no routed experts", "has none")
_NO_PEFT_HF_AUTO = ("peft wraps native linears only", "model.arch=hf_auto")
_NO_GEN_HF_AUTO = ("generate runs native modules: export, then transformers", "")

_ALL_LINEAR = ("peft=lora", "peft.targets=[all-linear]", "peft.target_experts=true")
# MoE families adapt their routed experts too (PEFT's target_parameters on the fused expert tensors).
_EXPERTS = ("peft=lora", "peft.target_experts=true")

# NF4 blocks the tiny hybrids' linears hold whole (their smallest, in_proj_b / a, 4 x 64: 256 elements).
_QLORA = ("peft=qlora", "peft.nf4_block_size=16", "peft.nf4_scaler_block_size=4")

# One line per family.
FAMILIES: list[Family] = [
    Family("llama", "llama_tied", tied=True, moe=False, layouts=DENSE, cannot={"ep": _NO_EP_DENSE}),
    Family("qwen2", "qwen2", tied=False, moe=False, layouts=DENSE, cannot={"ep": _NO_EP_DENSE}),
    Family("qwen3", "qwen3", tied=False, moe=False, layouts=DENSE, cannot={"ep": _NO_EP_DENSE}),
    Family("mistral", "mistral", tied=False, moe=False, layouts=DENSE, cannot={"ep": _NO_EP_DENSE}),
    Family("smollm3", "smollm3", tied=True, moe=False, layouts=DENSE, cannot={"ep": _NO_EP_DENSE}),
    Family(
        "olmo3",
        "olmo3",
        tied=False,
        moe=False,
        layouts=("ddp", "fsdp"),
        cannot={"tp": ("q/k norm spans every head", "strategy.tp=1"), "ep": _NO_EP_DENSE},
    ),
    Family("gemma3", "gemma3", tied=False, moe=False, layouts=DENSE, cannot={"ep": _NO_EP_DENSE}),
    Family("qwen3_moe", "qwen3_moe", tied=False, moe=True, layouts=MOE_LAYOUTS, lora=_EXPERTS),
    # peft=lora's default targets name gate_proj / up_proj / down_proj, which Mixtral's expert-only MLP has
    # not as linears: refused (a product gap, issue #50's matrix report), so its row targets all-linear.
    Family("mixtral", "mixtral", tied=False, moe=True, layouts=MOE_LAYOUTS, lora=_ALL_LINEAR),
    Family("glm4_moe", "glm4_moe", tied=False, moe=True, layouts=MOE_LAYOUTS, lora=_EXPERTS),
    # gpt-oss's experts are 3-D parameters and its router a gate: like Mixtral, no gate/up/down_proj linears.
    Family("gpt_oss", "gpt_oss", tied=False, moe=True, layouts=MOE_LAYOUTS, lora=_ALL_LINEAR),
    Family("deepseek_v3", "deepseek_v3", tied=False, moe=True, layouts=MOE_LAYOUTS, lora=_EXPERTS),
    Family(
        "qwen3_next",
        "qwen3_next",
        tied=False,
        moe=True,
        layouts=MOE_LAYOUTS,
        lora=_EXPERTS,
        qlora=(*_QLORA, "peft.target_experts=true"),
    ),
    Family(
        "qwen3_5",
        "qwen3_5",
        tied=False,
        moe=False,
        layouts=DENSE,
        cannot={"ep": _NO_EP_DENSE},
        qlora=_QLORA,
    ),
    Family(
        "qwen3_5_moe",
        "qwen3_5_moe",
        tied=False,
        moe=True,
        layouts=MOE_LAYOUTS,
        lora=_EXPERTS,
        qlora=(*_QLORA, "peft.target_experts=true"),
    ),
    Family(
        "hf_auto_tied",
        "llama_tied",
        tied=True,
        moe=False,
        layouts=DENSE,
        overrides=("model.arch=hf_auto",),
        cannot={"lora": _NO_PEFT_HF_AUTO, "generate": _NO_GEN_HF_AUTO, "ep": _NO_EP_DENSE},
    ),
    Family(
        "hf_auto_untied",
        "qwen2",
        tied=False,
        moe=False,
        layouts=DENSE,
        overrides=("model.arch=hf_auto",),
        cannot={"lora": _NO_PEFT_HF_AUTO, "generate": _NO_GEN_HF_AUTO, "ep": _NO_EP_DENSE},
    ),
]
BY_NAME = {f.name: f for f in FAMILIES}
NAMES = list(BY_NAME)

TOL = 1e-4
LAYOUT_STEPS = 2
PROMPT = "w3 w17 w42 w5 w99 w8"
NEW_TOKENS = 12  # past the tiny Mistral / OLMo 3 / Gemma 3 sliding window of 8
COMMON = ["training.seq_len=16", "training.global_batch=4", "optim.warmup_steps=1", "optim.lr=1e-2"]
# World 2, global batch 4: a data-parallel rank's 2 samples, or the TP group's 4.
LAYOUT_OVERRIDES = {
    "ddp": ["strategy=ddp", "training.micro_batch=2"],
    "fsdp": ["strategy=fsdp", "training.micro_batch=2"],
    "tp": ["strategy=tp", "training.micro_batch=4"],
    "ep": ["strategy=fsdp", "strategy.ep=2", "training.micro_batch=2"],
}


def _skip_if_cannot(family: Family, step: str) -> None:
    if step in family.cannot:
        pytest.skip(f"{family.name} cannot {step}: {family.cannot[step][0]} (refusal: test_refusals)")


@pytest.fixture(scope="module")
def dirs(tiny_hf_dirs, tiny_moe_hf_dirs) -> dict[str, Path]:
    """family name -> its tiny HF directory (the session's one directory per family)."""
    every = {**tiny_hf_dirs, **tiny_moe_hf_dirs}
    return {f.name: Path(every[f.hf_dir]) for f in FAMILIES}


def base_overrides(family: Family, path: Path) -> list[str]:
    return ["model=tiny", f"model.init_from=hf:{path}", *family.overrides]


def one_process(family: Family, path: Path) -> list[str]:
    return [*base_overrides(family, path), *COMMON, "launch.nproc_per_node=1"]


def _hf_model(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype="float32").eval()


# -- the table itself --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_table_is_true_to_the_directory(name: str, dirs) -> None:
    """The tied / MoE columns are what the family's config.json says."""
    family = BY_NAME[name]
    config = json.loads((dirs[name] / "config.json").read_text())
    assert bool(config.get("tie_word_embeddings", False)) == family.tied, config
    experts = ("num_experts", "num_local_experts", "n_routed_experts")  # the last: GLM-4.5's key
    assert any(k in config for k in experts) == family.moe, config
    assert set(family.layouts) | {k for k in family.cannot if k in LAYOUT_OVERRIDES} == set(LAYOUT_OVERRIDES)


def test_every_registered_hf_family_has_a_row() -> None:
    """A native family with a Hugging Face format joins the matrix (the registry is the source of names)."""
    from dtlaunch.models.registry import registry

    native = {arch for arch, spec in registry().items() if spec.hf_architectures}
    assert native <= set(NAMES), sorted(native - set(NAMES))


def test_refusals(dirs) -> None:
    """Every cell a family cannot do is refused by `validate` with one line naming the fix."""
    from dtlaunch.errors import ConfigError
    from dtlaunch.job.compose import compose
    from dtlaunch.job.validate import validate

    checked = 0
    for family in FAMILIES:
        for cell, (_, fragment) in family.cannot.items():
            if not fragment:
                continue
            extra = {"lora": ["peft=lora"]}.get(cell) or [*LAYOUT_OVERRIDES[cell], "launch.nproc_per_node=2"]
            if cell == "tp" and "model.arch=hf_auto" in family.overrides:
                extra.append("strategy.sequence_parallel=false")
            with pytest.raises(ConfigError) as err:
                validate(compose([*base_overrides(family, dirs[family.name]), *COMMON, *extra]).cfg)
            msg = str(err.value)
            assert "\n" not in msg and fragment in msg, (family.name, cell, msg)
            checked += 1
    assert checked >= 10


# -- 1. plan -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_plan_counts_transformers_parameters(name: str, dirs) -> None:
    from cli_in_process import run_cli_split

    family = BY_NAME[name]
    code, err, out = run_cli_split(["plan", *base_overrides(family, dirs[name])[1:]])
    assert code == 0, err[-2000:]
    count = int(re.search(r"([\d,]+) parameters", out).group(1).replace(",", ""))
    assert count == _hf_model(dirs[name]).num_parameters(), out[:300]


# -- 2. generate -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_generate_is_transformers_greedy(name: str, dirs) -> None:
    import torch
    from cli_in_process import run_cli_split
    from tokenizers import Tokenizer

    family = BY_NAME[name]
    _skip_if_cannot(family, "generate")
    path = dirs[name]
    code, err, out = run_cli_split(
        ["generate", f"hf:{path}", "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--temperature", "0"]
    )
    assert code == 0, err[-2000:]
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    prompt = tok.encode(PROMPT).ids
    with torch.no_grad():
        ids = (
            _hf_model(path)
            .generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=1, pad_token_id=1
            )[0, len(prompt) :]
            .tolist()
        )
    ids = ids[: ids.index(1)] if 1 in ids else ids  # the end token ends the continuation, unprinted
    # Ids past the tokenizer's 252 words (the model's vocabulary is 256) decode to nothing.
    words = [w for w in map(tok.id_to_token, ids) if w is not None]
    assert out.split() == words, (out, ids)


# -- 3. layouts (and 4. LoRA, 7. DPO / GRPO on one process) -----------------------------------------


def _layout_overrides(family: Family, path: Path, layout: str) -> list[str]:
    extra = ["strategy.sequence_parallel=false"] if layout == "tp" and "model.arch=hf_auto" in family.overrides else []
    return [*base_overrides(family, path), *COMMON, "launch.nproc_per_node=2", *LAYOUT_OVERRIDES[layout], *extra]


@pytest.fixture(scope="module")
def launched(dirs, tmp_path_factory) -> dict:
    """Every (family, layout) cell in one group of 2 forked workers."""

    def run_all() -> dict:
        return {
            f"{f.name}/{layout}": train(_layout_overrides(f, dirs[f.name], layout), 2, LAYOUT_STEPS)
            for f in FAMILIES
            for layout in f.layouts
        }

    return run_forked(2, run_all, tmp_path_factory.mktemp("family_lifecycle") / "results.json")


@pytest.mark.slow_reason("its first case's setup runs every family's layouts: one forked group of 2, ~30 runs")
@pytest.mark.parametrize("name", NAMES)
def test_layouts_match_one_process(name: str, dirs, launched) -> None:
    family = BY_NAME[name]
    # One process in 2 micro-batches of 2: each a data-parallel rank's batch (an MoE aux loss is per micro-batch).
    ref = train([*one_process(family, dirs[name]), "training.micro_batch=2"], 1, LAYOUT_STEPS)
    assert all(math.isfinite(x) for x in ref["loss"]), ref
    for layout in family.layouts:
        got = launched[f"{name}/{layout}"]
        diff = max(abs(a - b) for a, b in zip(got["loss"], ref["loss"], strict=True))
        assert diff <= TOL, (name, layout, got["loss"], ref["loss"])


def _value(p):
    """A parameter's value as a plain tensor (an NF4 weight's dequantised: torchao's NF4 clone re-quantises
    with its default block sizes)."""
    from dtlaunch.models.nf4 import is_nf4

    return p.get_original_weight() if is_nf4(p) else p.detach().clone()


def _snapshot(rt, _source) -> None:
    model = rt.model_parts[0]
    rt._lifecycle_before = {n: _value(p) for n, p in model.named_parameters()}


def _moved(rt) -> dict:
    import torch

    from dtlaunch.models.lora import ADAPTER_NAMES
    from dtlaunch.models.nf4 import is_nf4

    out: dict = {"adapters": 0, "adapters_moved": 0, "base_moved": [], "base_trainable": [], "nf4": 0}
    for n, p in rt.model_parts[0].named_parameters():
        moved = not torch.equal(_value(p), rt._lifecycle_before[n])
        out["nf4"] += is_nf4(p)
        if n.rsplit(".", 1)[-1] in ADAPTER_NAMES:
            out["adapters"] += 1
            out["adapters_moved"] += moved
        else:
            if moved:
                out["base_moved"].append(n)
            if p.requires_grad:
                out["base_trainable"].append(n)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_lora_trains_adapters_only(name: str, dirs) -> None:
    family = BY_NAME[name]
    _skip_if_cannot(family, "lora")
    over = [*one_process(family, dirs[name]), "training.micro_batch=4", *family.lora]
    r = train(over, 1, 2, prepare=_snapshot, inspect=_moved)
    moved = r["inspect"]
    assert moved["adapters"] > 0 and moved["adapters_moved"] == moved["adapters"], moved
    assert not moved["base_moved"] and not moved["base_trainable"], moved
    assert r["loss"][1] < r["loss"][0], r["loss"]


@pytest.mark.parametrize("name", [f.name for f in FAMILIES if f.qlora])
def test_qlora_trains_adapters_only(name: str, dirs) -> None:
    """The `lora` step on an NF4 base (the Gated DeltaNet projections among it): adapters only, the loss
    going down. The one process converts its frozen base as the worker does."""
    from dtlaunch.train.parallel.frozen_base import convert_frozen_base

    family = BY_NAME[name]
    over = [*one_process(family, dirs[name]), "training.micro_batch=4", *family.qlora]
    convert = lambda m, cfg: convert_frozen_base(m, cfg, 1)  # noqa: E731
    r = train(over, 1, 2, prepare=_snapshot, inspect=_moved, convert=convert)
    moved = r["inspect"]
    assert moved["nf4"] > 0 and moved["adapters"] > 0 and moved["adapters_moved"] == moved["adapters"], moved
    assert not moved["base_moved"] and not moved["base_trainable"], moved
    assert r["loss"][1] < r["loss"][0], r["loss"]


@pytest.mark.parametrize("name", NAMES)
def test_one_dpo_step(name: str, dirs) -> None:
    from test_dpo_layouts import pairs

    family = BY_NAME[name]
    over = [*one_process(family, dirs[name]), "training.micro_batch=4", "objective=dpo"]
    r = train(over, 1, 1, make_batches=pairs)
    assert math.isfinite(r["loss"][0]) and math.isfinite(r["grad_norm"][0]) and r["grad_norm"][0] > 0, r


class _RolloutRows:
    """A GRPO rollout's micro-batches without the generation (each family's decoding is step 2's): seeded
    prompt + completion rows, the prompt half masked, advantages of both signs, the step's completion-token
    count. (Seeded token batches carry no rollout: the step refuses them for objective=grpo.)"""

    def __init__(self, cfg, global_batch: int, dp_rank: int, dp_size: int, cp_rank: int, cp_size: int) -> None:
        import torch

        self.g = torch.Generator().manual_seed(int(cfg.training.seed) + dp_rank)
        self.rows, self.seq, self.vocab = (
            int(cfg.training.micro_batch),
            int(cfg.training.seq_len),
            int(cfg.model.vocab_size),
        )
        self.micro_steps = global_batch // (self.rows * dp_size)

    def next_batch(self):  # noqa: ANN201 (a MicroBatch)
        import torch

        from dtlaunch.train.batch import MicroBatch, RolloutRows
        from dtlaunch.train.data import IGNORE_INDEX

        tokens = torch.randint(0, self.vocab, (self.rows, self.seq + 1), generator=self.g)
        inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
        targets[:, : self.seq // 2] = IGNORE_INDEX  # the prompt's positions: no loss
        adv = torch.tensor([1.0, -1.0] * (self.rows // 2) + [0.5] * (self.rows % 2))
        completion_tokens = (targets != IGNORE_INDEX).sum().float() * self.micro_steps
        return MicroBatch(inputs, targets, rollout=RolloutRows(adv=adv, step_tokens=completion_tokens))


@pytest.mark.parametrize("name", NAMES)
def test_one_grpo_step(name: str, dirs) -> None:
    """GRPO's loss (its token log-probs of the family's output, the clipped ratio, the advantages) and its
    gradients on a rollout's rows: finite, and non-zero."""
    family = BY_NAME[name]
    over = [
        *one_process(family, dirs[name]),
        "objective=grpo",
        "data.kind=synthetic",
        "objective.max_completion_length=4",
        "objective.num_generations=2",
        "training.micro_batch=4",
    ]
    r = train(over, 1, 1, make_batches=_RolloutRows)
    # One iteration per rollout: the ratio's value is 1 and the loss's is minus the advantages' token mean,
    # 0 for rows of +1 and -1 with as many completion tokens (a cross-entropy would be ~log(vocab)); its
    # gradient is the policy gradient's, not 0.
    assert abs(r["loss"][0]) < 1e-6 and math.isfinite(r["grad_norm"][0]) and r["grad_norm"][0] > 0, r


# -- 5. resume and 6. export -------------------------------------------------------------------------

# (family, step) -> the test that runs that cell already (not run again here: CI time).
COVERED = {
    (
        "llama",
        "resume",
    ): "tests/distributed/test_resume_matrix.py::test_sigkilled_run_resumes_bit_identical[native_tied_sft]",
    (
        "qwen2",
        "resume",
    ): "tests/distributed/test_resume_matrix.py::test_sigkilled_run_resumes_bit_identical[native_qwen2_untied_lora]",
    (
        "hf_auto_tied",
        "resume",
    ): "tests/distributed/test_resume_matrix.py::test_sigkilled_run_resumes_bit_identical[hf_auto_tied_sft]",
    (
        "hf_auto_untied",
        "resume",
    ): "tests/distributed/test_resume_matrix.py::test_sigkilled_run_resumes_bit_identical[hf_auto_untied_sft]",
    **{
        (f, "export"): f"tests/e2e/test_hf_families_train.py::test_export_reproduces_the_original_directory[{d}]"
        for f, d in (
            ("llama", "llama_tied"),
            ("qwen2", "qwen2"),
            ("qwen3", "qwen3"),
            ("mistral", "mistral"),
            ("qwen3_moe", "qwen3_moe"),
        )
    },
}
RESUME = [
    "training.steps=4",
    "data=synthetic",
    "training.micro_batch=2",
    "training.global_batch=4",
    "training.seq_len=16",
]


def _cell(name: str, step: str) -> None:
    if (name, step) in COVERED:
        pytest.skip(f"{name} {step}: covered by {COVERED[name, step]}")


@pytest.fixture(scope="module")
def straight_runs(dirs, tmp_path_factory):
    """family -> the run directory of its uninterrupted 4-step run (checkpoints at steps 2 and 4), run once."""
    from test_resume_matrix import COMMON as RESUME_COMMON
    from test_resume_matrix import log_tail, start, worker_imports  # noqa: F401 (imports before the fork)

    cache: dict[str, Path] = {}

    def get(name: str) -> tuple[list[str], Path]:
        args = [*base_overrides(BY_NAME[name], dirs[name]), *RESUME, *RESUME_COMMON]
        if name not in cache:
            run_dir = tmp_path_factory.mktemp(f"straight_{name}")
            assert start(args, run_dir) == 0, log_tail(run_dir)
            cache[name] = run_dir
        return args, cache[name]

    return get


@pytest.mark.parametrize("name", NAMES)
def test_sigkilled_run_resumes_bit_identical(name: str, straight_runs, tmp_path: Path) -> None:
    import signal

    from test_resume_matrix import KILL, log_tail, losses, start

    _cell(name, "resume")
    args, straight = straight_runs(name)
    want = losses(straight)
    assert [s for s, _ in want] == [1, 2, 3, 4], want
    killed = tmp_path / "killed"
    assert start([*args, *KILL], killed) == -signal.SIGKILL, log_tail(killed)
    assert start(args, killed) == 0, log_tail(killed)
    assert losses(killed) == want  # exact floats


@pytest.mark.parametrize("name", NAMES)
def test_hf_export_loads_in_transformers(name: str, dirs, straight_runs, tmp_path: Path) -> None:
    import torch
    from cli_in_process import run_cli_split

    from dtlaunch.infer.generate import load_source

    _cell(name, "export")
    _, run_dir = straight_runs(name)
    out = tmp_path / "export"
    code, err, _ = run_cli_split(["ckpt", "export", str(run_dir), "--format", "hf", "--out", str(out)])
    assert code == 0, err[-2000:]
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = _hf_model(out)(tokens).logits
        if "model.arch=hf_auto" in BY_NAME[name].overrides:
            # The checkpoint holds transformers' own state dict: the source's model with the trained tensors.
            # (`load_source` of an hf_auto run fails: PreTrainedModel.init_weights takes no seed, reported.)
            from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

            step = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
            dcp_to_torch_save(step, tmp_path / "ckpt.pt")
            model = _hf_model(dirs[name])
            missing, unexpected = model.load_state_dict(torch.load(tmp_path / "ckpt.pt")["model"], strict=False)
            assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
            model.tie_weights()
            ours = model(tokens).logits
        else:
            ours = load_source(str(run_dir), torch.device("cpu"), max_len=16).model(tokens).float()
    assert (ours - theirs).abs().max().item() < TOL
    # The source directory's architecture again (hf_auto writes the source's config.json back).
    source = json.loads((dirs[name] / "config.json").read_text())["architectures"]
    assert json.loads((out / "config.json").read_text())["architectures"] == source


# -- docs/models.md's table --------------------------------------------------------------------------

DOC_COLUMNS = ("ddp", "fsdp", "tp", "ep", "lora", "generate", "resume", "export", "dpo", "grpo")


def doc_table() -> str:
    """FAMILIES as docs/models.md shows it: ✓ where the matrix runs the cell (here or in COVERED's test),
    the reason where the family cannot."""
    head = ["family", "tied", "MoE", "DDP", "FSDP", "TP", "EP", "LoRA", "generate", "resume", "export", "DPO", "GRPO"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for f in FAMILIES:
        cells = [f"`{f.name}`", "yes" if f.tied else "no", "yes" if f.moe else "no"]
        for col in DOC_COLUMNS:
            cells.append(f"no: {f.cannot[col][0]}" if col in f.cannot else "✓")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def test_docs_table_matches() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "models.md").read_text()
    assert doc_table() in doc, "docs/models.md's life-cycle table differs from FAMILIES:\n" + doc_table()


@pytest.mark.parametrize("name", [f.name for f in FAMILIES if "generate" in f.cannot])
def test_generate_refuses_in_one_line(name: str, straight_runs) -> None:
    """`generate RUN_DIR` of a run it cannot decode (hf_auto): exit 2 and one line naming the way out."""
    from cli_in_process import run_cli_split

    _, run_dir = straight_runs(name)
    code, err, _ = run_cli_split(["generate", str(run_dir), "--prompt", PROMPT, "--max-new-tokens", "2"])
    lines = [x for x in err.splitlines() if x.startswith("dtlaunch: error")]
    assert code == 2 and len(lines) == 1 and "model.arch=hf_auto run" in lines[0] and "ckpt export" in lines[0], err


def test_default_lora_targets_fit_every_family(dirs) -> None:
    """peft=lora's default names the MLP; where it is routed experts only (Mixtral) it adapts the attention,
    while an explicit list naming an expert is still refused (tests/unit/test_lora.py)."""
    from dtlaunch.job.compose import compose
    from dtlaunch.job.validate import validate

    for f in FAMILIES:
        if "lora" not in f.cannot:
            validate(compose([*one_process(f, dirs[f.name]), "training.micro_batch=4", "peft=lora"]).cfg)
