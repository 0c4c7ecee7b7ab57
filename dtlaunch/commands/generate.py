"""`dtlaunch generate SOURCE --prompt TEXT`: the continuation on stdout, everything else on stderr."""

from __future__ import annotations

import sys
import time

from dtlaunch.errors import InputError


def generate_command(
    source: str, prompt: str, max_new_tokens: int, temperature: float, top_p: float, seed: int, adapter: str = ""
) -> int:
    if max_new_tokens < 1:
        raise InputError(f"--max-new-tokens {max_new_tokens} must be >= 1")
    if temperature < 0 or not 0 < top_p <= 1:
        raise InputError(f"--temperature {temperature} / --top-p {top_p}: need temperature >= 0 and 0 < top_p <= 1")
    import torch

    from dtlaunch.infer.generate import generate_ids, load_source, set_positions

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    start = time.perf_counter()
    loaded = load_source(source, device, adapter=adapter)
    ids = [int(i) for i in loaded.tokenizer.encode(prompt.encode("utf-8"))]
    if not ids:
        raise InputError("--prompt is empty after tokenisation: give some text")
    set_positions(loaded.model, len(ids) + max_new_tokens)
    print(
        f"loaded {loaded.m.arch} model from {source} in {time.perf_counter() - start:.1f}s on {device}", file=sys.stderr
    )
    new = generate_ids(loaded.model, ids, max_new_tokens, temperature, top_p, seed, loaded.eos_id, loaded.stop_ids)
    stopped = bool(new) and (new[-1] == loaded.eos_id or new[-1] in loaded.stop_ids)
    if stopped:
        new = new[:-1]
    sys.stdout.write(loaded.tokenizer.decode(new))
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(f"{len(new)} new tokens in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    if not stopped:
        print(
            f"the continuation hit --max-new-tokens {max_new_tokens} before an end token (ids "
            f"{list(loaded.stop_ids)}): raise --max-new-tokens to see more",
            file=sys.stderr,
        )
    return 0
