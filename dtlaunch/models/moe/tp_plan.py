"""Tensor-parallel plan of the MoE decoder: the dense decoder's plan for the embedding, head and attention;
in the FFN the router stays whole on every tensor-parallel rank (each computes the same choice), the routed
experts are split on their hidden width (`RoutedExperts`: every rank runs every routed copy through its
slice of each expert and the slices' outputs are summed), the shared experts and the dense blocks' SwiGLU
column / row-parallel as in the dense decoder. A plan key naming a module a block lacks (a dense block's
`experts`, a sparse block's `w1`) is skipped for that block (dtlaunch.train.parallel.tensor_parallel).
Under sequence parallel the FFN's input is gathered and its output, whole on every rank, cut back to this
rank's positions.
"""

from __future__ import annotations

from typing import Any

from dtlaunch.models.dense import tp_plan as dense
from dtlaunch.models.tp_styles import Colwise, PrepareInputOutput, RoutedExperts, Rowwise, Style


def model_plan(m: Any, sequence_parallel: bool) -> dict[str, Style]:
    return dense.model_plan(m, sequence_parallel)


def block_plan(m: Any, sequence_parallel: bool) -> dict[str, Style]:
    plan = {k: v for k, v in dense.block_plan(m, sequence_parallel).items() if not k.startswith("feed_forward")}
    for ffn in ("feed_forward", "feed_forward.shared_experts"):
        plan.update({f"{ffn}.w1": Colwise(), f"{ffn}.w3": Colwise(), f"{ffn}.w2": Rowwise()})
    plan["feed_forward.experts"] = RoutedExperts()
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
