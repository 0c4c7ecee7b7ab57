"""The names of a memory plan's lines: what `dtlaunch plan` prints and `--json` writes as categories.

One enum, so that the phases (dtlaunch.plan.stage, dtlaunch.plan.backward), offloading
(dtlaunch.plan.offload), the objectives' and the rollout's terms and the reports name a line the same
way. Each member is its text (a `str`): plan dictionaries keyed by a member compare, hash, print and
serialise exactly as the text did.
"""

from __future__ import annotations

from enum import Enum


class Line(str, Enum):
    """One line of a stage's plan, in bytes on one rank (device unless the name says host)."""

    # Held for the whole step (dtlaunch.plan.stage.static_lines).
    PARAMETERS = "parameters"
    ADAPTER_PARAMETERS = "adapter parameters"
    NF4_BASE_WEIGHTS = "NF4 base weights"
    BUFFERS = "buffers"
    ROPE_CP_POSITIONS = "RoPE tables (CP positions)"
    ROPE_COMPUTE_DTYPE = "RoPE tables (compute dtype)"
    OPTIMIZER_STATE = "optimizer state"
    REFERENCE_COPY = "reference copy"
    DDP_BUCKETS = "DDP buckets"
    ACCUMULATED_GRADIENTS = "accumulated gradients"
    AUTOCAST_WEIGHT_COPIES = "autocast weight copies"
    UNSHARDED_PARAMETERS = "unsharded parameters"
    FLOAT8_CASTS = "float8 casts"
    # Added by forward (forward_lines).
    ACTIVATIONS = "activations"
    LORA_ACTIVATIONS = "LoRA activations"
    ALL_TO_ALL_BUFFERS = "all-to-all buffers"
    # A phase's transient on top of the lines above, when that phase is the stage's peak.
    LOSS_BACKWARD_BUFFERS = "loss/backward buffers"
    ALL_GATHER_BUFFERS = "all-gather buffers"
    REFERENCE_FORWARD_BUFFERS = "reference forward buffers"
    # At the optimizer step (optimizer_lines).
    GRADIENTS = "gradients"
    OPTIMIZER_TEMPORARIES = "optimizer temporaries"
    # GRPO's generation phase (dtlaunch.plan.generation).
    KV_CACHE = "KV cache"
    PREFILL_SAMPLING_BUFFERS = "prefill / sampling buffers"
    # Host RAM (dtlaunch.plan.offload).
    HOST_ACTIVATIONS = "activations (pinned host)"
    PARAMETERS_HOST = "parameters (host)"
    ADAPTER_PARAMETERS_HOST = "adapter parameters (host)"
    OPTIMIZER_STATE_HOST = "optimizer state (host)"
    ACCUMULATED_GRADIENTS_HOST = "accumulated gradients (host)"
    GRADIENTS_HOST = "gradients (host)"
    OPTIMIZER_TEMPORARIES_HOST = "optimizer temporaries (host)"
    # GRPO's user-code process (dtlaunch.inputs.tools): at most its address-space limit, per rank.
    TOOL_PROCESS_HOST = "tool process (host, objective.tool_memory_mb)"
    # Device overheads outside torch's allocator (dtlaunch.plan.memory; from the hardware profile).
    CUDA_CONTEXT = "CUDA context"
    COMMUNICATOR_BUFFERS = "communicator buffers"
    ALLOCATOR_FRAGMENTATION = "allocator fragmentation"

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


# Where an offloaded line's bytes are reported in host RAM.
ON_HOST = {
    Line.ACTIVATIONS: Line.HOST_ACTIVATIONS,
    Line.LORA_ACTIVATIONS: Line.HOST_ACTIVATIONS,
    Line.PARAMETERS: Line.PARAMETERS_HOST,
    Line.ADAPTER_PARAMETERS: Line.ADAPTER_PARAMETERS_HOST,
    Line.OPTIMIZER_STATE: Line.OPTIMIZER_STATE_HOST,
    Line.ACCUMULATED_GRADIENTS: Line.ACCUMULATED_GRADIENTS_HOST,
    Line.GRADIENTS: Line.GRADIENTS_HOST,
    Line.OPTIMIZER_TEMPORARIES: Line.OPTIMIZER_TEMPORARIES_HOST,
}
