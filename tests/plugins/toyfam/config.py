"""The toy family's own model field, beside the fields every family shares."""

from dataclasses import dataclass

from dtlaunch.config.schema import ModelConfig


@dataclass
class ToyConfig(ModelConfig):
    # The MLP's hidden width, in multiples of model.dim.
    mlp_ratio: int = 4
