"""The `dtlaunch` command line. Thin: each command parses arguments and calls one function.

Nothing heavy is imported at module level (no torch, no hydra): `dtlaunch --help` starts fast.
Every expected failure is a DtlaunchError, printed as one line on stderr with its exit code;
`--debug` shows the traceback instead.
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional

import typer

from dtlaunch import __version__
from dtlaunch.errors import exit_code_of

app = typer.Typer(
    name="dtlaunch",
    help="Config-driven launcher for distributed PyTorch training: compose a recipe, plan its memory, launch.",
    no_args_is_help=True,
    epilog=(
        "Environment: DTLAUNCH_DEBUG=1 (tracebacks, as --debug), DTLAUNCH_PROGRESS=plain (step lines instead of "
        "the live bar), DTLAUNCH_RECIPE_PATH=dir1:dir2 (more recipes), COLUMNS (table width); the rest is in the "
        "README. Exit codes: 0 ok, 1 worker failure, 2 bad input, 3 memory plan does not fit, 75 preempted "
        "(checkpoint saved)."
    ),
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
ckpt_app = typer.Typer(help="List, inspect, verify and export checkpoints.", no_args_is_help=True)
data_app = typer.Typer(help="Prepare datasets (tokenize text into token shards).", no_args_is_help=True)
app.add_typer(ckpt_app, name="ckpt")
app.add_typer(data_app, name="data")
recipes_app = typer.Typer(help="List, show and copy recipes.")
app.add_typer(recipes_app, name="recipes")


def _complete_overrides(ctx: typer.Context, incomplete: str) -> list[str]:
    from dtlaunch.job.completion import complete_words

    # The overrides already typed (parsed into the context by the completion machinery).
    return complete_words(list(ctx.params.get("overrides") or []), incomplete)


def _complete_recipe_names(incomplete: str) -> list[str]:
    from dtlaunch.job.completion import complete_override

    return [c.split("=", 1)[1] for c in complete_override(f"recipe={incomplete}")]


OVERRIDES = typer.Argument(
    None,
    help="recipe=NAME|PATH and Hydra overrides: key=value, +key=value, ~key, group=option",
    autocompletion=_complete_overrides,
)
RECIPE_DIRS = typer.Option(None, "--recipe-dir", help="Extra recipe directory (repeatable; also $DTLAUNCH_RECIPE_PATH)")

_DEBUG = False


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dtlaunch {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks instead of one-line errors."),
) -> None:
    global _DEBUG
    _DEBUG = debug or os.environ.get("DTLAUNCH_DEBUG") == "1"


@app.command()
def train(
    overrides: Optional[List[str]] = OVERRIDES,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan, config and launch command; launch nothing."),
    force: bool = typer.Option(False, "--force", help="Launch even if the memory plan does not fit."),
    no_resume: bool = typer.Option(
        False, "--no-resume", help="Start from step 1; old checkpoints move to checkpoints.prev-<time>/."
    ),
    recipe_dir: Optional[List[str]] = RECIPE_DIRS,
    multirun: bool = typer.Option(
        False, "-m", "--multirun", help="Sweep: one run per combination of key=a,b / range() / choice() values."
    ),
    cfg: Optional[str] = typer.Option(None, "--cfg", help="'job': print the composed config and exit (Hydra's flag)."),
) -> None:
    """Compose, validate, plan and launch a training run (torchrun workers); -m runs a sweep."""
    if cfg is not None:
        from dtlaunch.commands.config import cfg_flag_command

        raise typer.Exit(cfg_flag_command(cfg, overrides or [], recipe_dir or []))
    if multirun:
        from dtlaunch.commands.sweep import sweep_train_command

        raise typer.Exit(
            sweep_train_command(overrides or [], recipe_dir or [], dry_run=dry_run, force=force, no_resume=no_resume)
        )
    from dtlaunch.commands.train import train_command

    raise typer.Exit(
        train_command(
            overrides or [], recipe_dir or [], dry_run=dry_run, force=force, no_resume=no_resume, report=exit_code
        )
    )


@app.command()
def plan(
    overrides: Optional[List[str]] = OVERRIDES,
    as_json: bool = typer.Option(False, "--json", help="Emit the plan as JSON."),
    search: bool = typer.Option(False, "--search", help="Search parallel layouts that fit and rank them by speed."),
    top: int = typer.Option(10, "--top", help="How many layouts --search prints."),
    trace: bool = typer.Option(
        False,
        "--trace",
        help="Also run the real build and step for the most loaded rank in one process and show its traced peak (seconds to a minute; no interleaved PP, no PP x TP).",
    ),
    maximize: str = typer.Option(
        "",
        "--maximize",
        metavar="KEY",
        help="Print the largest training.seq_len or training.micro_batch (objective=grpo: also objective.num_generations, objective.max_completion_length) that fits (device and host memory) with the rest of the job fixed, and the override to paste.",
    ),
    recipe_dir: Optional[List[str]] = RECIPE_DIRS,
) -> None:
    """Per-rank memory plan against the target GPU; exit 3 if it does not fit."""
    from dtlaunch.commands.plan import maximize_command, plan_command

    if maximize:
        raise typer.Exit(maximize_command(overrides or [], recipe_dir or [], maximize, as_json=as_json))
    raise typer.Exit(
        plan_command(overrides or [], recipe_dir or [], as_json=as_json, search=search, top=top, trace=trace)
    )


@app.command()
def validate(overrides: Optional[List[str]] = OVERRIDES, recipe_dir: Optional[List[str]] = RECIPE_DIRS) -> None:
    """Compose and check every rule; exit 0 if valid, 2 if not."""
    from dtlaunch.commands.config import validate_command

    raise typer.Exit(validate_command(overrides or [], recipe_dir or []))


@app.command()
def config(
    overrides: Optional[List[str]] = OVERRIDES,
    resolve: bool = typer.Option(False, "--resolve", help="Resolve interpolations such as ${stdlib:}."),
    recipe_dir: Optional[List[str]] = RECIPE_DIRS,
) -> None:
    """Print the composed config as YAML."""
    from dtlaunch.commands.config import config_command

    raise typer.Exit(config_command(overrides or [], recipe_dir or [], resolve=resolve))


@recipes_app.callback(invoke_without_command=True)
def recipes(ctx: typer.Context, recipe_dir: Optional[List[str]] = RECIPE_DIRS) -> None:
    """List the recipes: model, parameters, strategy, world size, hardware, whether the plan fits."""
    if ctx.invoked_subcommand is not None:
        ctx.obj = recipe_dir or []
        return
    from dtlaunch.commands.recipes import recipes_command

    raise typer.Exit(recipes_command(recipe_dir or []))


@recipes_app.command("show")
def recipes_show(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Recipe name.", autocompletion=_complete_recipe_names),
    recipe_dir: Optional[List[str]] = RECIPE_DIRS,
) -> None:
    """Print a recipe's YAML."""
    from dtlaunch.commands.recipes import show_command

    raise typer.Exit(show_command(name, [*(ctx.obj or []), *(recipe_dir or [])]))


@recipes_app.command("cp")
def recipes_cp(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Recipe name.", autocompletion=_complete_recipe_names),
    dest: Optional[str] = typer.Argument(None, help="File or directory (default ./NAME.yaml); .yaml is added."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing file."),
    recipe_dir: Optional[List[str]] = RECIPE_DIRS,
) -> None:
    """Copy a recipe to edit, then run it with recipe=./DEST.yaml."""
    from dtlaunch.commands.recipes import cp_command

    raise typer.Exit(cp_command(name, dest, force, [*(ctx.obj or []), *(recipe_dir or [])]))


@ckpt_app.command("ls")
def ckpt_ls(run: str = typer.Argument(..., help="Run directory (runs/<name>) or its checkpoints directory.")) -> None:
    """List a run's checkpoints: step, time, size, the layout that wrote each, complete or not."""
    from dtlaunch.commands.ckpt import ls_command

    raise typer.Exit(ls_command(run))


@ckpt_app.command("inspect")
def ckpt_inspect(
    checkpoint: str = typer.Argument(..., help="A step-XXXXXXXX directory, or a run (its newest intact)."),
    tensors: bool = typer.Option(False, "--tensors", help="List every tensor (name, shape, dtype, chunks)."),
) -> None:
    """What a checkpoint holds (per-module parameters, bytes, dtypes) and which layout wrote it."""
    from dtlaunch.commands.ckpt import inspect_command

    raise typer.Exit(inspect_command(checkpoint, tensors=tensors))


@ckpt_app.command("verify")
def ckpt_verify(run: str = typer.Argument(..., help="Run directory, its checkpoints directory, or one step.")) -> None:
    """Check every checkpoint's files against the checksums recorded at save; exit 2 if any is corrupt."""
    from dtlaunch.commands.ckpt import verify_command

    raise typer.Exit(verify_command(run))


@ckpt_app.command("export")
def ckpt_export(
    src: str = typer.Argument(
        ..., help="A run directory (its newest complete checkpoint) or a step-XXXXXXXX directory."
    ),
    fmt: str = typer.Option(
        "hf",
        "--format",
        help="hf (safetensors + config.json of the model's architecture; a LoRA run: the base with the adapters "
        "merged), torch, or peft (a LoRA run's adapters for peft.PeftModel.from_pretrained).",
    ),
    out: str = typer.Option(..., "--out", help="Output directory."),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="hf: split safetensors above this size."),
) -> None:
    """Export a checkpoint to Hugging Face safetensors, one consolidated torch file, or peft adapters."""
    from dtlaunch.commands.ckpt import export_command

    raise typer.Exit(export_command(src, fmt, out, max_shard_size))


@app.command()
def generate(
    source: str = typer.Argument(..., help="hf:DIR, a run directory (newest checkpoint) or a checkpoint directory."),
    prompt: str = typer.Option(..., "--prompt", help="Text to continue."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Tokens to generate at most (EOS stops early)."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy; > 0 samples."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling: keep the most likely tokens up to this mass."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed."),
    adapter: str = typer.Option(
        "", "--adapter", help="A peft LoRA adapter directory to apply to an hf:DIR base (merged into its weights)."
    ),
) -> None:
    """Continue a prompt with dtlaunch's own model code (KV cache, one process). Stdout: the text only."""
    from dtlaunch.commands.generate import generate_command

    raise typer.Exit(generate_command(source, prompt, max_new_tokens, temperature, top_p, seed, adapter))


@app.command("eval")
def eval_(
    source: str = typer.Argument(..., help="hf:DIR, a run directory (newest checkpoint) or a checkpoint directory."),
    tasks: str = typer.Option(..., "--tasks", help="lm-evaluation-harness task names, comma-separated."),
    limit: int = typer.Option(0, "--limit", help="Samples per task at most (0 = all)."),
    num_fewshot: int = typer.Option(-1, "--num-fewshot", help="Few-shot examples (-1 = each task's own)."),
    batch_size: int = typer.Option(8, "--batch-size", help="Requests per forward pass."),
    include: str = typer.Option("", "--include", help="A directory of task YAML files of your own."),
    adapter: str = typer.Option("", "--adapter", help="A peft LoRA adapter directory for an hf:DIR base."),
    apply_chat_template: bool = typer.Option(
        False, "--apply-chat-template", help="Render prompts with the tokenizer's chat template."
    ),
    out: str = typer.Option("", "--out", help="Results directory (default RUN/eval; ./eval for hf:DIR)."),
) -> None:
    """Evaluate with lm-evaluation-harness on dtlaunch's own model (one process); results in RUN/eval/."""
    from dtlaunch.commands.eval import eval_command

    raise typer.Exit(
        eval_command(source, tasks, limit, num_fewshot, batch_size, include, adapter, apply_chat_template, out)
    )


@data_app.command("prepare")
def data_prepare(
    inputs: List[str] = typer.Argument(
        ...,
        help="Files, directories or globs: text files (--pattern inside directories), .jsonl, .parquet, or a dataset.",
    ),
    out: str = typer.Option(..., "--out", help="Output directory for the shards and meta.json."),
    tokenizer: str = typer.Option("byte", "--tokenizer", help="'byte' or the path of a local tokenizer.json."),
    shard_tokens: int = typer.Option(100_000_000, "--shard-tokens", help="Tokens per shard file."),
    pattern: str = typer.Option("**/*", "--pattern", help="File pattern inside directory inputs."),
    max_bytes: int = typer.Option(0, "--max-bytes", help="Stop after this many bytes of text (0 = all; text kind)."),
    kind: str = typer.Option(
        "text",
        "--kind",
        help="text (each file one document; JSON input is refused), jsonl (one JSON object per line), parquet "
        "(a column), hf (a datasets save_to_disk directory or local data files).",
    ),
    text_field: str = typer.Option(
        "text", "--text-field", help="jsonl/parquet/hf: the field (column) holding the text."
    ),
    split: str = typer.Option("train", "--split", help="hf: the split of a DatasetDict or of local data files."),
) -> None:
    """Tokenize text into uint16/uint32 token shards (train with data.kind=tokens data.path=OUT).

    The same sources train directly with data.kind=jsonl|parquet|hf (tokenized once into a cache)."""
    from dtlaunch.commands.data import prepare_command

    raise typer.Exit(prepare_command(inputs, out, tokenizer, shard_tokens, pattern, max_bytes, kind, text_field, split))


@app.command()
def download(
    sources: Optional[List[str]] = typer.Argument(
        None,
        help="hf:ORG/NAME or hf:ORG/NAME@REVISION (a model: config, weights, tokenizer), dataset:ORG/NAME(@REVISION).",
    ),
) -> None:
    """Fetch hub models and datasets into the cache (HF_HOME / HF_HUB_CACHE) ahead of `submit`."""
    from dtlaunch.commands.download import download_command

    raise typer.Exit(download_command(sources or []))


@app.command()
def submit(
    overrides: Optional[List[str]] = OVERRIDES,
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print the sbatch script / Kubernetes manifests / SkyPilot task; submit nothing."
    ),
    force: bool = typer.Option(False, "--force", help="Submit even if the memory plan does not fit."),
    recipe_dir: Optional[List[str]] = RECIPE_DIRS,
    multirun: bool = typer.Option(False, "-m", "--multirun", help="Sweep: submit one Slurm job array, a task a point."),
) -> None:
    """Submit the job to Slurm, Kubernetes (Kubeflow) or SkyPilot: cluster=slurm|kubernetes|skypilot."""
    if multirun:
        from dtlaunch.commands.sweep import sweep_submit_command

        raise typer.Exit(sweep_submit_command(overrides or [], recipe_dir or [], dry_run=dry_run, force=force))
    from dtlaunch.commands.submit import submit_command

    raise typer.Exit(submit_command(overrides or [], recipe_dir or [], dry_run=dry_run, force=force))


@app.command()
def status(
    run: Optional[str] = typer.Argument(None, help="Run directory (or a name under --root); none: recent runs."),
    root: Optional[str] = typer.Option(None, "--root", help="Where runs live (run.root; default runs)."),
    as_json: bool = typer.Option(False, "--json", help="Emit the state as JSON."),
) -> None:
    """A run's state (running/finished/failed/preempted), step, loss, newest checkpoint, pid; Slurm runs ask Slurm."""
    from dtlaunch.commands.status import run_status_command

    raise typer.Exit(run_status_command(run, root, as_json=as_json))


@app.command()
def debug(
    run: str = typer.Argument(..., help="Run directory (or a name under --root) of a live local run."),
    root: Optional[str] = typer.Option(None, "--root", help="Where runs live (run.root; default runs)."),
    py_spy: bool = typer.Option(False, "--py-spy", help="Read the stacks with py-spy instead of a signal."),
) -> None:
    """Every rank's Python stacks of a live run, now (SIGUSR2 -> faulthandler into the rank logs, or py-spy)."""
    from dtlaunch.commands.debug import debug_command

    raise typer.Exit(debug_command(run, root, py_spy=py_spy))


@app.command()
def report(
    run: str = typer.Argument(..., help="Run directory (runs/<name>) or sweep directory."),
    out: Optional[str] = typer.Option(None, "--out", help="HTML file to write (default RUN/report.html)."),
) -> None:
    """One self-contained HTML page: loss, speed, memory vs plan, step-time breakdown, checkpoints, config."""
    from dtlaunch.commands.report import report_command

    raise typer.Exit(report_command(run, out))


def run() -> None:
    """Console entry point: one-line errors with documented exit codes."""
    from dtlaunch.run.known_noise import silence_known_noise

    silence_known_noise()  # before anything imports torch or torchao
    try:
        # Non-standalone mode returns the exit code of typer.Exit instead of exiting.
        code = app(standalone_mode=False) or 0
    except BaseException as exc:
        code = exit_code(exc)
    sys.exit(code)


def console_main() -> None:
    """The console script and `python -m dtlaunch`: `run`, then, once torch is loaded (train, generate,
    ckpt, plan --trace, ...), exit without the interpreter's teardown. Unloading torch's modules took
    0.5-2 s after every such command, seconds that every `dtlaunch train` and every CLI test paid for
    nothing. The exit handlers still run (logging, temporary directories, trackers); a non-daemon thread
    still alive gets the ordinary exit, which waits for it. In-process callers use `run` (SystemExit)."""
    from dtlaunch.run.fast_exit import exit_now, other_threads_alive

    code = 0
    try:
        run()
    except SystemExit as stop:
        code = stop.code
        if "torch" not in sys.modules or not isinstance(code, int) or other_threads_alive():
            raise
    exit_now(code)


def exit_code(exc: BaseException) -> int:
    """errors.exit_code_of with this invocation's --debug."""
    return exit_code_of(exc, debug=_DEBUG)


if __name__ == "__main__":
    console_main()
