"""Sharded, atomic, resumable checkpoints with torch.distributed.checkpoint (DCP).

On disk (`run_dir/checkpoint.dir/`):
  .tmp-step-00000100/   every rank writes its shard here (DCP `.distcp` files + `.metadata`)
  step-00000100/        the same directory once complete: rank 0 adds `trainer_state.json` and the
                        marker `COMPLETE.json` (file sizes and checksums, layout, config hash) and renames it.
A directory without a valid marker, or whose files do not match the marker, is never loaded. Checksums
are computed while the files are written (integrity.py) and verified before a checkpoint is used.

What is saved: one dict of `Stateful` states (dtlaunch/train/checkpoint/states.py): the model and optimizer states
through DCP (DDP, FSDP2, TP DTensors and pipeline stage parts alike; parameter names are the full
model's in every layout, and the optimizer state is flattened to `state.<fqn>.<key>` so parts merge and
reshard freely), per-rank RNG states (tensors keyed by rank), and - as JSON, never pickle - the LR
schedulers' state, step, consumed samples/tokens, the data loader's global position, the config hash
and the layout that wrote it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from dtlaunch.convert.dcp_planner import safe_load_planner
from dtlaunch.errors import EXIT_WORKER_FAILED, ConfigError, DtlaunchError
from dtlaunch.run.checkpoints import (
    FORMAT_VERSION,
    MARKER,
    STATE_FILE,
    TMP_PREFIX,
    checkpoint_root,
    config_hash,
    layout_description,
    layout_str,
    newest_complete,
    refuse_if_checkpoints,
    remove_tree,
    resolve_load_path,
    scan_checkpoints,
    step_dir_name,
)
from dtlaunch.run.env import NO_RESUME_ENV
from dtlaunch.run.phases import phase

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

# States kept in the JSON trainer state (plain numbers, never pickle) rather than in DCP's files.
JSON_STATES = ("schedulers",)


class CheckpointSaveError(DtlaunchError):
    """Writing a checkpoint failed (disk full, permissions): the run stops, older checkpoints stay."""

    exit_code = EXIT_WORKER_FAILED


# ---------------------------------------------------------------------------------------------
# The manager (inside the workers).


def _log(msg: str) -> None:
    print(f"[checkpoint] {msg}", flush=True)


class CheckpointManager:
    """Saves on a cadence (sync or async), resumes from the newest complete checkpoint."""

    def __init__(
        self,
        cfg: JobConfig,
        run_dir: Path,
        model_parts: list,
        optimizers: list,
        schedulers: list,
        loader: Any,
        rank: int,
    ) -> None:
        import torch.distributed as dist

        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.root = checkpoint_root(cfg, run_dir)
        self.model_parts = list(model_parts)
        self.optimizers = list(optimizers)
        self.schedulers = list(schedulers)
        self.loader = loader
        self.rank = rank
        self.enabled = bool(cfg.checkpoint.enabled)
        self.every_steps = int(cfg.checkpoint.every_steps)  # read once: the loop asks every step
        self.dist = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size() if self.dist else 1
        if len(self.optimizers) not in (0, len(self.model_parts)) and not (
            len(self.optimizers) == 1 and len(self.model_parts) == 1
        ):
            raise ValueError("CheckpointManager needs one optimizer per model part")
        self.async_save = bool(cfg.checkpoint.async_save) and self.enabled
        # Async writes run collectives from a background thread: give them their own gloo group so
        # they never interleave with the training loop's collectives on the default group.
        self.pg = dist.new_group(backend="gloo") if (self.dist and self.async_save) else None
        self._pending: Optional[tuple[Any, int, Path, dict]] = None
        self._staging: Optional[Any] = None  # future: the async save's copy of the state is complete
        self._stager = _make_stager() if self.async_save else None
        self.blocked_s = 0.0  # time async saves held the training loop (start + waits for staging)
        if self._stager is not None:
            # The copy runs in the background while the next forward/backward runs; only the optimizer
            # step changes what is being copied, so that is where the loop waits for it.
            for opt in self.optimizers:
                opt.register_step_pre_hook(lambda *_: self.wait_staged())
        self.last_saved_step = -1
        from dtlaunch.train.features.fault_injection import Faults

        # debug.slow_save_s (kill-during-save tests): rank 1's writes start late; otherwise the writer as is.
        self._writer = Faults.of(cfg, rank).wrap_writer(_ChecksummedWriter)
        from dtlaunch.convert.base_fingerprint import peft_record
        from dtlaunch.train.checkpoint.states import train_states

        # peft: only the adapters are saved; the marker names the frozen base they belong to.
        self.peft = peft_record(cfg)
        # Model and optimizer go through DCP, the schedulers into the JSON trainer state.
        self.states = train_states(self.model_parts, self.optimizers, self.schedulers, self.peft is not None)

    # ---- state --------------------------------------------------------------------------------

    def _tensor_states(self) -> dict[str, Any]:
        return {k: v for k, v in self.states.items() if k not in JSON_STATES}

    def _rng_state(self) -> dict:
        import torch

        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state()
        return {f"rank{self.rank}": rng}

    def _trainer_state(self, step: int) -> dict:
        from dtlaunch.config.decisions import Decisions
        from dtlaunch.config.layout import Layout

        gb = Decisions.of(self.cfg, Layout.resolve(self.cfg.strategy, self.world)).global_batch
        loader_state = self.loader.state_dict() if self.loader is not None else {}
        return {
            "format": FORMAT_VERSION,
            "step": step,
            "consumed_samples": step * gb,
            "consumed_tokens": step * gb * int(self.cfg.training.seq_len),
            "loader": loader_state,
            **{k: v for name in JSON_STATES for k, v in self.states[name].state_dict().items()},
        }

    # ---- save ---------------------------------------------------------------------------------

    def maybe_save(self, step: int) -> None:
        """Save when the cadence says so; also finalises a finished async save."""
        if not self.enabled:
            return
        self._poll_pending()
        if self.every_steps > 0 and step % self.every_steps == 0:
            self.save(step, final=False)

    def save(self, step: int, final: bool = False) -> None:
        if not self.enabled or step == self.last_saved_step:
            return
        import torch.distributed.checkpoint as dcp

        self._wait_pending()
        tmp = self.root / f"{TMP_PREFIX}{step:08d}"
        if self.rank == 0:
            remove_tree(tmp)  # a stale attempt at this step from a killed run
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise CheckpointSaveError(f"cannot create checkpoint directory '{self.root}': {exc}") from exc
        self._barrier()
        state: dict[str, Any] = {**self._tensor_states(), "rng": self._rng_state()}
        trainer_state = self._trainer_state(step)
        writer = self._writer(str(tmp))
        started = time.perf_counter()
        try:
            if self.async_save and not final:
                resp = dcp.async_save(state, storage_writer=writer, process_group=self.pg, async_stager=self._stager)
                self._staging = resp.staging_completion
                self._pending = (resp.upload_completion, step, tmp, trainer_state)
                self.last_saved_step = step
                self.blocked_s += time.perf_counter() - started
                if self.rank == 0:
                    _log(f"step {step}: async save started ({time.perf_counter() - started:.2f}s blocking)")
                return
            dcp.save(state, storage_writer=writer, process_group=self.pg)
        except _SAVE_ERRORS() as exc:
            self._fail(tmp, exc)
        self._barrier()
        self._finalize(step, tmp, trainer_state)
        self.last_saved_step = step
        if self.rank == 0:
            _log(f"step {step}: saved {step_dir_name(step)} in {time.perf_counter() - started:.2f}s")

    def wait_staged(self) -> None:
        """Block until the async save in flight has its own copy of the state (before it may change)."""
        if self._staging is None:
            return
        started = time.perf_counter()
        staging, self._staging = self._staging, None
        try:
            staging.result()
        except _SAVE_ERRORS() as exc:
            self._fail(self._pending[2] if self._pending else self.root, exc)
        self.blocked_s += time.perf_counter() - started

    def _poll_pending(self) -> None:
        if self._pending is not None and self._pending[0].done():
            self._wait_pending()

    def _wait_pending(self) -> None:
        if self._pending is None:
            return
        self.wait_staged()
        fut, step, tmp, trainer_state = self._pending
        self._pending = None
        try:
            fut.result()
        except _SAVE_ERRORS() as exc:
            self._fail(tmp, exc)
        # Rank 0 is DCP's coordinator: its save returns only after every rank's shard is written and
        # the global `.metadata` is on disk, so it can mark the checkpoint complete on its own.
        self._finalize(step, tmp, trainer_state)
        if self.rank == 0:
            _log(f"step {step}: async save complete (async saves held training {self.blocked_s:.2f}s so far)")

    def _fail(self, tmp: Path, exc: BaseException) -> None:
        # The partial directory stays (never loadable: no marker): the next start names it when skipping
        # it, and it is deleted by the next save of that step or once a newer checkpoint is complete.
        prev, _ = newest_complete(self.root)
        kept = f"; the previous checkpoint {prev.name} is intact" if prev else ""
        raise CheckpointSaveError(f"saving checkpoint into '{tmp}' failed: {_root_cause(exc)}{kept}") from exc

    def _finalize(self, step: int, tmp: Path, trainer_state: dict) -> None:
        """Rank 0: trainer state + marker (with every file's size), then the atomic rename, then pruning."""
        if self.rank != 0:
            return
        final = self.root / step_dir_name(step)
        try:
            from dtlaunch.run.checksums import default_algorithm, digest_bytes, digest_file
            from dtlaunch.train.checkpoint.integrity import collect_sidecars

            state_bytes = _write_json(tmp / STATE_FILE, trainer_state)
            algorithm, digests = collect_sidecars(tmp)
            algorithm = algorithm or default_algorithm()
            digests[STATE_FILE] = digest_bytes(state_bytes, algorithm)
            files = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
            for rel in files:
                if rel not in digests:  # not written through DCP's streams (never expected): hash from disk
                    digests[rel] = digest_file(tmp / rel, algorithm)
            marker = {
                "format": FORMAT_VERSION,
                "step": step,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "layout": layout_description(self.cfg, self.world),
                "config_hash": config_hash(self.cfg),
                "model_hash": config_hash(self.cfg, "model"),
                "model": {k: v for k, v in _model_dict(self.cfg).items()},
                "consumed_samples": trainer_state["consumed_samples"],
                "consumed_tokens": trainer_state["consumed_tokens"],
                "files": files,
                "bytes": sum(files.values()),
                "checksums": {"algorithm": algorithm, "files": digests},
            }
            if self.peft is not None:
                marker["peft"] = self.peft
            _write_json(tmp / MARKER, marker)
            if final.exists():  # re-saving a step after resuming from an older checkpoint
                remove_tree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
        except OSError as exc:
            self._fail(tmp, exc)
        self._prune(step)

    def _prune(self, newest: int) -> None:
        keep = int(self.cfg.checkpoint.keep_last)
        infos = scan_checkpoints(self.root)
        complete = [i for i in infos if i.complete]
        if keep > 0:
            for info in complete[:-keep]:
                remove_tree(info.path)
        # Leftovers of killed saves older than this one are garbage now.
        for info in infos:
            if not info.complete and info.step < newest:
                remove_tree(info.path)

    def close(self) -> None:
        """Wait for an async save in flight and mark it complete."""
        self._wait_pending()
        self._barrier()

    # ---- resume -------------------------------------------------------------------------------

    def resume(self) -> int:
        """Load the newest complete checkpoint (or checkpoint.load_path); return the step to start from."""
        if not self.enabled and not self.cfg.checkpoint.load_path:
            return 0
        if os.environ.get(NO_RESUME_ENV) == "1":
            refuse_if_checkpoints(self.cfg, self.run_dir)
            return 0
        choice = self._choose() if self.rank == 0 else None
        choice = self._broadcast(choice)
        if choice is None:
            return 0
        path = Path(choice["path"])
        marker = choice["marker"]
        if marker.get("model_hash") != config_hash(self.cfg, "model"):
            raise ConfigError(
                f"checkpoint '{path}' was written for a different model ({marker.get('model', {}).get('name')}, "
                f"hash {marker.get('model_hash')}): resume with the same model config or start a new run.dir"
            )
        from dtlaunch.convert.base_fingerprint import check_base

        check_base(self.cfg, marker, f"checkpoint '{path}'")
        phase(f"loading checkpoint {path.name}")
        started = time.perf_counter()
        self._load(path, marker)
        if self.rank == 0:
            _log(
                f"resumed from {path.name} (step {marker['step']}, written by {layout_str(marker.get('layout', {}))}) "
                f"in {time.perf_counter() - started:.2f}s"
            )
        self.last_saved_step = int(marker["step"])
        return int(marker["step"])

    def _choose(self) -> Optional[dict]:
        load_path = str(self.cfg.checkpoint.load_path)
        if load_path:
            p = Path(load_path)
            info, skipped = resolve_load_path(p if p.is_absolute() or p.exists() else self.run_dir / p, verify=True)
        else:
            info, skipped = newest_complete(self.root, verify=True)
        for s in skipped:
            _log(f"skipping checkpoint {s.name}: {s.reason}")
        if skipped and info is not None:
            _log(f"falling back to {info.name} (step {info.step}), the newest intact checkpoint")
        if info is None:
            return None
        return {"path": str(info.path), "marker": info.marker}

    def _load(self, path: Path, marker: dict) -> None:
        import torch
        import torch.distributed.checkpoint as dcp

        saved_keys = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
        # DCP reads into each state's state_dict() and hands the result to its load_state_dict().
        state: dict[str, Any] = self._tensor_states()
        # RNG streams belong to ranks: restore them only when the world is the one that saved.
        same_world = marker.get("layout", {}).get("world") == self.world
        rng_key = f"rank{self.rank}"
        if same_world and f"rng.{rng_key}.cpu" in saved_keys:
            rng = {"cpu": torch.get_rng_state()}
            if f"rng.{rng_key}.cuda" in saved_keys and torch.cuda.is_available():
                rng["cuda"] = torch.cuda.get_rng_state()
            state["rng"] = {rng_key: rng}
        dcp.load(state, checkpoint_id=str(path), planner=safe_load_planner(), process_group=self.pg)
        if "rng" in state:
            torch.set_rng_state(state["rng"][rng_key]["cpu"])
            if "cuda" in state["rng"][rng_key]:
                torch.cuda.set_rng_state(state["rng"][rng_key]["cuda"])
        trainer = json.loads((path / STATE_FILE).read_text())
        for name in JSON_STATES:
            try:
                self.states[name].load_state_dict(trainer)
            except ConfigError as exc:
                raise ConfigError(f"checkpoint '{path}': {exc}") from exc
        if self.loader is not None and trainer.get("loader"):
            self.loader.load_state_dict(trainer["loader"])

    # ---- collectives --------------------------------------------------------------------------

    def _barrier(self) -> None:
        if self.dist:
            import torch.distributed as dist

            dist.barrier()

    def _broadcast(self, obj: Any) -> Any:
        if not self.dist:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


# ---------------------------------------------------------------------------------------------
# DCP plumbing.


def _make_checksummed_writer_class() -> type:
    import torch.distributed.checkpoint as dcp

    from dtlaunch.run.checksums import default_algorithm
    from dtlaunch.train.checkpoint.integrity import hashing_filesystem, write_sidecar

    class ChecksummedWriter(dcp.FileSystemWriter):
        """FileSystemWriter whose streams checksum what they write (the digests go into a sidecar file per
        writer for rank 0's marker)."""

        def __init__(self, path: str) -> None:
            super().__init__(path)
            self.fs = hashing_filesystem(default_algorithm())

        def write_data(self, plan: Any, planner: Any) -> Any:
            fut = super().write_data(plan, planner)
            fut.wait()  # FileSystemWriter writes synchronously: its future is already done
            tag = str(plan.storage_data.prefix).strip("_") or "0"
            write_sidecar(Path(self.path), f"rank{tag}", self.fs.algorithm, dict(self.fs.digests))
            return fut

        def finish(self, metadata: Any, results: Any) -> None:
            super().finish(metadata, results)
            digests = {k: v for k, v in self.fs.digests.items() if k == ".metadata"}
            write_sidecar(Path(self.path), "metadata", self.fs.algorithm, digests)

    return ChecksummedWriter


def _ChecksummedWriter(path: str) -> Any:  # noqa: N802 (factory standing in for the class: dcp imported late)
    global _CHECKSUMMED_WRITER
    if _CHECKSUMMED_WRITER is None:
        _CHECKSUMMED_WRITER = _make_checksummed_writer_class()
    return _CHECKSUMMED_WRITER(path)


_CHECKSUMMED_WRITER: Any = None


def _make_stager() -> Any:
    """One stager for the whole run: it keeps its copy buffers between saves (filled again, not
    reallocated), and copies in a background thread. Pinned memory and non-blocking copies need CUDA."""
    import torch
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = torch.cuda.is_available()
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=cuda
        )
    )


def _SAVE_ERRORS() -> tuple:  # noqa: N802
    """DCP gathers every rank's failure into a CheckpointException, which derives from BaseException."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def _root_cause(exc: BaseException) -> str:
    """The innermost OSError's text (disk full, permission denied) if there is one, else the first line."""
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return f"{type(e).__name__}: {e}"
        failures = getattr(e, "failures", None)  # DCP's CheckpointException: {rank: exception}
        if isinstance(failures, dict):
            stack.extend(v for v in failures.values() if isinstance(v, BaseException))
        stack.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _write_json(path: Path, obj: dict) -> bytes:
    data = json.dumps(obj, indent=1, sort_keys=True).encode()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return data


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _model_dict(cfg: JobConfig) -> dict:
    from dtlaunch.config.schema import to_dict

    return dict(to_dict(cfg)["model"])
