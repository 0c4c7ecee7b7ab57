"""How the model is spread over ranks: mesh, process group, TP/CP/EP/PP, AC, float8, FSDP/DDP, weight init."""
