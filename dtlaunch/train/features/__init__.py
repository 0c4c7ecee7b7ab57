"""What the training loop can switch on, beside its core (train/: main, trainer, runtime, step, loss, data,
optim): evaluation, LoRA / QLoRA, an MoE model's router statistics, the tiled MLP, activation offload, the
low-bit and in-backward optimizers, the planner's traced step (memory_trace) and the tests' fault injection
(debug.*, wrapped around the loop's pieces at setup, never on a real run's path)."""
