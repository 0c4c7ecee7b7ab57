"""Tensor-parallel plan of the MoE decoder: the dense decoder's plan for the embedding, head and attention;
the FFN (router, experts, shared experts, or a dense block's SwiGLU) stays whole on every tensor-parallel
rank and computes the full sequence (experts are split by expert parallelism, not by tensor parallel).
Under sequence parallel its input is gathered and its output cut back to this rank's positions.
"""

from __future__ import annotations

from typing import Any

from dtlaunch.models.dense import tp_plan as dense
from dtlaunch.models.tp_styles import PrepareInputOutput, Style


def model_plan(m: Any, sequence_parallel: bool) -> dict[str, Style]:
    return dense.model_plan(m, sequence_parallel)


def block_plan(m: Any, sequence_parallel: bool) -> dict[str, Style]:
    plan = {k: v for k, v in dense.block_plan(m, sequence_parallel).items() if not k.startswith("feed_forward")}
    if sequence_parallel:
        plan["feed_forward"] = PrepareInputOutput(
            inputs=("shard(1)",),
            desired_inputs=("replicate",),
            outputs=("replicate",),
            desired_outputs=("shard(1)",),
            local_input=True,
            local_output=True,
        )
    return plan
