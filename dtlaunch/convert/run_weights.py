"""The weights of a dtlaunch run's checkpoint, read like a Hugging Face directory's (`read(name, shape,
offset)`, dtlaunch.convert.hf.HFWeights): DPO's objective.reference=RUN_DIR.

The values are exactly those `dtlaunch ckpt export RUN --format hf` writes (dtlaunch.convert.hf
load_checkpoint_model, dtlaunch.convert.adapters merged_run_state), bit for bit, but each rank reads only
its own blocks, never the whole model:
- a full run: the block of each tensor from the run's DCP checkpoint (dtlaunch.convert.dcp_blocks), in its
  saved dtype, then fp32, as the whole read converts it;
- a LoRA run: its adapters (small) whole, the base's block from model.init_from's directory (HFWeights),
  plus scaling * (B A)'s block. The product B A is computed whole, one linear at a time, and cut: a matmul
  of B's rows and A's columns alone takes other BLAS paths (gemv for one row or one column) whose sums
  differ in the last bit from the whole product's;
- a QLoRA run: as LoRA, but every block linear's base is read whole, one at a time, rounded to NF4 and
  back as the run trained on it, and cut: NF4's double quantisation scales each block by statistics of the
  whole tensor's scalers (their mean), so no block can be rounded alone.
Host memory per read is the block plus at most one whole tensor (its saved chunk, its B A, its QLoRA base).
"""

from __future__ import annotations

from typing import Any, Optional

from dtlaunch.errors import InputError
from dtlaunch.models.dtypes import torch_dtype

ADAPTER_LEAVES = ("lora_a", "lora_b")


def _block_index(full: tuple, shape: Optional[tuple], offset: Optional[tuple]) -> tuple:
    shape = tuple(shape) if shape is not None else tuple(full)
    offset = tuple(offset) if offset is not None else (0,) * len(shape)
    return tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))


def _model_tensors(blocks: Any, m: Any, path: Any) -> dict[str, str]:
    """our parameter name -> its DCP key, checked as load_checkpoint_model checks the whole state (some
    model tensors, of the shapes the marker's model has)."""
    import torch

    from dtlaunch.convert.hf import _check_marker_shapes

    keys = {k[len("model.") :]: k for k in blocks.tensors if k.startswith("model.")}
    if not keys:
        raise InputError(f"checkpoint '{path}' holds no model tensors")
    shapes = {n: torch.empty(tuple(blocks.tensors[k].size), device="meta") for n, k in keys.items()}
    _check_marker_shapes(shapes, m, path)
    return keys


class FullRunWeights:
    """A full fine-tuning run's parameters, block by block from its DCP checkpoint."""

    def __init__(self, path: Any, m: Any, where: str) -> None:
        from dtlaunch.convert.dcp_blocks import DcpBlocks
        from dtlaunch.models.registry import model_spec

        self.blocks, self.where = DcpBlocks(path), where
        self.keys = _model_tensors(self.blocks, m, path)
        # The persistent buffers the checkpoint holds (the MoE router's expert bias): loaded with the weights.
        meta = model_spec(m).build(m, rope_len=1, device="meta")
        self.buffers = {n for n, _ in meta.named_buffers()} & set(self.keys)

    def read(self, name: str, shape: Optional[tuple] = None, offset: Optional[tuple] = None) -> Any:
        if name not in self.keys:
            raise InputError(f"{self.where}: the checkpoint holds no {name}: give a run of the model trained here")
        return self.blocks.read(self.keys[name], shape, offset).float()


class LoraRunWeights:
    """A LoRA / QLoRA run's base with its adapters merged, block by block."""

    def __init__(self, path: Any, m: Any, record: dict, where: str) -> None:
        from dtlaunch.convert.adapters import Adapters, base_dir
        from dtlaunch.convert.dcp_blocks import DcpBlocks
        from dtlaunch.convert.hf import HFWeights

        blocks = DcpBlocks(path)
        keys = _model_tensors(blocks, m, path)
        # As load_run_adapters reads them: the adapters whole, the scaling alpha / rank.
        tensors = {n: blocks.read(k) for n, k in keys.items() if n.rsplit(".", 1)[-1] in ADAPTER_LEAVES}
        self.adapters = Adapters(tensors, float(record["alpha"]) / int(record["rank"]), dict(record), m)
        self.base = HFWeights(base_dir(record, f"checkpoint '{path}'"), m)
        self.buffers = self.base.buffers  # adapters never touch them
        self.where = where
        self._check_shapes(f"checkpoint '{path}'")
        self.nf4_rounded = self._nf4_rounded_weights()

    def _check_shapes(self, where: str) -> None:
        """merge's checks of every adapter against its base weight, run on meta tensors (no values)."""
        import torch

        from dtlaunch.convert.adapters import Adapters, merge

        meta = {n: torch.empty(s, device="meta") for n, s in self.base.shapes.items()}
        a = self.adapters
        merge(meta, Adapters({k: v.to("meta") for k, v in a.tensors.items()}, a.scaling, a.record, a.m), where)

    def _nf4_rounded_weights(self) -> set[str]:
        """The weights QLoRA trained against NF4-rounded (adapters._dequantized's): every block linear's."""
        if self.adapters.record.get("method") != "qlora":
            return set()
        from dtlaunch.models.lora import candidate_linears
        from dtlaunch.models.registry import meta_model, model_spec

        spec = model_spec(self.adapters.m)
        return {f"{fqn}.weight" for fqn in candidate_linears(meta_model(self.adapters.m), spec)}

    def _nf4_round(self, w: Any) -> Any:
        """adapters._dequantized for one weight: NF4 from the training dtype, as the run quantised it, and back."""
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        rec = self.adapters.record
        dtype = torch_dtype(rec.get("base_dtype", "bf16"))
        q = to_nf4(w.to(dtype).contiguous(), int(rec["nf4_block_size"]), int(rec["nf4_scaler_block_size"]))
        return q.get_original_weight().to(w.dtype)

    def read(self, name: str, shape: Optional[tuple] = None, offset: Optional[tuple] = None) -> Any:
        if name not in self.base.shapes:
            raise InputError(f"{self.where}: the run's base holds no {name}: give a run of the model trained here")
        index = _block_index(self.base.shapes[name], shape, offset)
        if name in self.nf4_rounded:
            w = self._nf4_round(self.base.read(name))[index]
        else:
            w = self.base.read(name, shape, offset)
        fqn = name.rsplit(".", 1)[0]
        a, b = self.adapters.tensors.get(f"{fqn}.lora_a"), self.adapters.tensors.get(f"{fqn}.lora_b")
        if a is None or b is None or not name.endswith(".weight"):
            return w.float()
        # adapters.merge's arithmetic, element for element: the whole product, then this block of it.
        delta = (b.float() @ a.float())[index]
        return (w.float() + self.adapters.scaling * delta).to(w.dtype).float()


def run_weights(ref: str, m: Any) -> Any:
    """objective.reference=RUN_DIR's weights, its checks run again here (the run may have changed since
    the launch)."""
    from dtlaunch.job.model_schema import model_config_from_marker
    from dtlaunch.job.reference_run import reference_checkpoint
    from dtlaunch.run.phases import phase

    info = reference_checkpoint(ref, m)
    where = f"objective.reference='{ref}' ({info.path})"
    run_model = model_config_from_marker(info.marker)
    record = info.marker.get("peft")
    weights = (
        LoraRunWeights(info.path, run_model, record, where) if record else FullRunWeights(info.path, run_model, where)
    )
    phase(f"objective.reference: the weights of {info.path}, read block by block")
    return weights
