"""Bad input gets one line on stderr that names the key, exit code 2, and never a traceback.

Runs the real console entry point in-process (the same code path as the `dtlaunch` script).
"""

from __future__ import annotations

import sys

import pytest

from dtlaunch.cli import run

# (arguments after `dtlaunch validate`, text the one-line error must contain)
BAD_INPUTS: list[tuple[list[str], str]] = [
    (["training.micro_bach=2"], "training.micro_bach"),
    (["profiling.enabled=true", "training.steps=2", "profiling.steps=[5]"], "profiling.steps=[5]"),
    (["profiling.steps=[0]"], "profiling.steps"),
    (["training.micro_bach=2"], "did you mean 'micro_batch'"),
    (["trainig.steps=3"], "trainig"),
    (["training.steps=abc"], "training.steps"),
    (["training.compile=maybe"], "training.compile"),
    (["training.loss_plot=maybe"], "expected true or false; fix: training.loss_plot=<true or false>"),
    (["optim.lr=fast"], "optim.lr"),
    (["model=llama9"], "model"),
    (["strategy=zero4"], "strategy"),
    (["hardware=h100_8gb"], "hardware"),
    (["recipe=nope"], "recipe 'nope'"),
    (["recipe=./missing.yaml"], "missing.yaml"),
    (["recipe=tiny_tp", "launch.nproc_per_node=3", "strategy.tp=3"], "strategy.tp=3"),
    (["strategy.dp_shard=3"], "strategy.dp_shard"),
    (["strategy.tp=-1", "strategy.dp_shard=-1"], "both -1"),
    (["strategy.pp=2", "strategy.dp_shard=1", "model.n_layers=1", "strategy.pp_microbatches=2"], "model.n_layers"),
    (["training.global_batch=7"], "training.global_batch"),
    (["recipe=tiny_pp", "strategy.pp_microbatches=1"], "strategy.pp_microbatches"),
    (["recipe=tiny_pp", "strategy.pp_schedule=interleaved_1f1b"], "strategy.pp_stages_per_rank"),
    (["strategy.zero_stage=4"], "strategy.zero_stage"),
    (["recipe=tiny_tp", "strategy.zero_stage=1"], "strategy.zero_stage"),
    (["recipe=tiny_tp", "launch.nproc_per_node=4", "strategy.tp=2", "strategy.dp_shard=-1"], "strategy.zero_stage=0"),
    (["precision.param_dtype=fp16"], "precision.loss_scaling"),
    (["strategy.cpu_offload=true"], "strategy.zero_stage=0"),
    (["recipe=tiny_fsdp", "launch.nproc_per_node=1", "strategy=ddp", "strategy.cpu_offload=true"], "zero_stage=2"),
    (["recipe=tiny_tp", "strategy=fsdp_tp", "launch.nproc_per_node=4", "strategy.cpu_offload=true"], "strategy.tp=2"),
    (["recipe=tiny_fsdp", "strategy.cpu_offload=true", "hardware.host_memory_gib=0"], "hardware.host_memory_gib"),
    (["training.activation_offload=true", "training.compile=true"], "training.compile=false"),
    (
        ["training.activation_offload=true", "training.compile=true", "training.activation_checkpointing=selective"],
        "training.activation_checkpointing=full",
    ),
    (["recipe=tiny_pp", "training.activation_offload=true"], "strategy.pp=2"),
    (["precision.residual_dtype=bf16"], "precision.param_dtype=bf16"),
    (["precision.residual_dtype=fp64"], "precision.residual_dtype"),
    (["recipe=tiny_fsdp", "precision=bf16", "precision.residual_dtype=fp32"], "precision.residual_dtype=auto"),
    (["recipe=tiny_pp", "precision=bf16", "strategy.zero_stage=0", "precision.residual_dtype=bf16"], "strategy.pp=1"),
    (["hardware.host_memory_gib=-1"], "hardware.host_memory_gib"),
    (["hardware.host_link_gbps=nan"], "hardware.host_link_gbps"),
    (["precision.param_dtype=fp8"], "precision.param_dtype"),
    (["training.seq_len=100000"], "training.seq_len"),
    (["checkpoint.every_steps=0"], "checkpoint.every_steps"),
    (["checkpoint.load_path=/nonexistent/step-1"], "checkpoint.load_path"),
    (["data=tokens", "data.path=/nonexistent/shards"], "data.path"),
    (["data=tokens"], "data.path"),
    (["data.tokenizer=/nonexistent/tokenizer.json"], "data.tokenizer"),
    (["training.activation_checkpointing=partial"], "training.activation_checkpointing"),
    (["strategy.pp_schedule=zigzag"], "strategy.pp_schedule"),
    (["+training.foo=1"], "training.foo"),
    (["~model.nonexistent"], "model.nonexistent"),
    (["~model.rope_scalin"], "did you mean 'rope_scaling'"),
    (["launch.nnodes=2"], "launch.rdzv_endpoint"),
    (["model.n_kv_heads=3"], "model.n_kv_heads"),
    (["training.steps=["], "training.steps=["),
    (["optim.schedule=step"], "optim.schedule"),
    (["optim.name=sgd"], "optim.name"),
    (["optim.state_dtype=fp8"], "optim.state_dtype"),
    (["optim.state_dtype=bf16"], "optim.state_dtype=bf16 with peft.method=none"),
    (["peft=lora", "optim.state_dtype=bf16"], "precision.param_dtype=bf16"),
    (["optim.name=adamw8bit", "optim.state_dtype=bf16"], "optim.state_dtype=fp32"),
    (["optim.name=adamw8bit", "recipe=tiny_tp"], "strategy.tp=2"),
    (["optim.name=adamw4bit", "strategy=zero1", "launch.nproc_per_node=2"], "strategy.zero_stage=1"),
    (["optim.in_backward=true"], "training.grad_clip=0"),
    (
        ["optim.in_backward=true", "training.grad_clip=0", "strategy=zero3", "training.global_batch=64"],
        "global_batch=0",
    ),
    (["optim.in_backward=true", "training.grad_clip=0", "strategy=ddp", "launch.nproc_per_node=2"], "zero_stage"),
    (["optim.in_backward=true", "training.grad_clip=0", "recipe=tiny_pp"], "strategy.pp=2"),
    (["optim.in_backward=maybe"], "optim.in_backward"),
    (
        ["optim.in_backward=true", "training.grad_clip=0", "recipe=tiny_fsdp", "strategy.cpu_offload=true"],
        "strategy.cpu_offload=false",
    ),
    (["training.micro_batch=0"], "training.micro_batch"),
    (["training.loss_chunks=-1"], "training.loss_chunks=-1"),
    (["training.loss_chunks=many"], "training.loss_chunks"),
    (["training.loss_chunks=2.5"], "training.loss_chunks"),
    (["--recipe-dir", "/nonexistent/recipes", "recipe=x"], "/nonexistent/recipes"),
    # DeepSeek-V3's latent attention gives each tensor-parallel rank whole heads.
    (
        [
            "model=deepseek_v3_671b",
            "strategy=tp",
            "launch.nproc_per_node=2",
            "model.n_heads=7",
            "model.n_kv_heads=7",
        ],
        "model.n_heads=7 (num_attention_heads) is not divisible by strategy.tp=2",
    ),
]


def run_cli(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(sys, "argv", ["dtlaunch", *argv])
    with pytest.raises(SystemExit) as exc:
        run()
    return int(exc.value.code or 0)


@pytest.mark.parametrize(("args", "expected"), BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_one_line_exit_2(
    args: list[str], expected: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code = run_cli(["validate", *args], monkeypatch)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("dtlaunch: error: ")
    assert expected in lines[0]


def test_enough_bad_inputs() -> None:
    assert len(BAD_INPUTS) >= 25


def test_valid_input_exit_0(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["validate", "recipe=tiny_3d"], monkeypatch) == 0
    assert "valid" in capsys.readouterr().out


def test_unknown_command_is_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_cli(["trian"], monkeypatch) == 2


@pytest.mark.parametrize("how", ["--debug", "DTLAUNCH_DEBUG=1"])
@pytest.mark.parametrize("bad", ["training.stepz=1", "strategy.tp=3"])
def test_debug_shows_traceback_and_keeps_the_exit_code(
    how: str, bad: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if how == "--debug":
        argv = ["--debug", "validate", "recipe=tiny_ddp", bad]
    else:
        monkeypatch.setenv("DTLAUNCH_DEBUG", "1")
        argv = ["validate", "recipe=tiny_ddp", bad]
    code = run_cli(argv, monkeypatch)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" in err and "ConfigError" in err
    assert err.strip().splitlines()[-1].startswith("dtlaunch: error: "), err
