"""peft.targets' default, torch-free: the schema's default (dtlaunch.config.schema.PeftConfig) and the rule that
lets the default, and only the default, skip a model's routed experts (dtlaunch.models.lora.select_targets)."""

# Attention's q, v, output and the MLP: torchtune's shipped Llama-3 LoRA choice (k adds little, the MLP
# adapters most of the quality; the output head stays frozen).
DEFAULT_TARGETS = ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
