"""Batched generation with dtlaunch's own model modules: the rollout phase of objective=grpo, and the
batched path `dtlaunch generate` can share.

Prompts of different lengths are left-padded into one (rows, prompt) block; each row's RoPE positions
start at its first real token and attention ignores the padding (KVCache.key_mask), so every row sees
exactly what it would see alone. The KV cache is allocated once for prompt + max_new_tokens positions and
written in place. A row stops at its first stop id (EOS, end of turn), which it keeps; the batch stops
when every row has, or after max_new_tokens. Sampling follows transformers' order: temperature, top-k,
top-p; temperature 0 is greedy. Draws come from the caller's torch.Generator (seeded per rank and step
by the rollout, so a resumed run draws the same tokens), one uniform per row (inverse CDF).

Tensor parallel: the head's logits arrive sharded on the vocabulary and are gathered whole for sampling
(every TP rank then draws the same token from the same generator). Sequence parallel shards each
forward's positions over the TP ranks, so every forward must carry a multiple of `sequence_multiple`
positions: the prompts get that much more left padding (masked like the rest), and each decode step
feeds its new token followed by copies of it at the same position, which attention never reads (they
sit after the real token, and are overwritten in the cache by the next step's token).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from dtlaunch.models.dense.model import KVCache


class PreallocatedKVCache(KVCache):
    """A block's keys and values for `capacity` positions, allocated at the first append (its head count
    is the module's: under tensor parallel, this rank's heads) and filled in place."""

    def __init__(self, capacity: int, key_mask: torch.Tensor, masks: dict[Optional[int], torch.Tensor]) -> None:
        super().__init__()
        self.capacity, self.filled = capacity, 0
        self.key_mask = key_mask  # (rows, capacity), shared by every block's cache, updated by the decoder
        # This forward's attention masks by sliding window, shared by every block's cache: the blocks see
        # the same positions, so the first block builds the mask and the others reuse it (the decoder
        # empties it before each forward).
        self.masks = masks

    def step_mask(self, window: Optional[int], build: Callable[[], torch.Tensor]) -> torch.Tensor:
        mask = self.masks.get(window)
        if mask is None:
            mask = self.masks[window] = build()
        return mask

    @property
    def length(self) -> int:
        return self.filled

    def keep_rows(self, keep: torch.Tensor, key_mask: torch.Tensor) -> None:
        """Only the rows `keep` (ascending) stay, moved to the front of the same storage (their filled
        positions): dropping rows allocates no second cache, so generation's peak memory stays the plan's."""
        assert self.k is not None and self.v is not None
        n, f = len(keep), self.filled
        self.k[:n, :f] = self.k[keep, :f]
        self.v[:n, :f] = self.v[keep, :f]
        self.k, self.v, self.key_mask = self.k[:n], self.v[:n], key_mask

    def drop_last(self, n: int) -> None:
        """Forget the last `n` positions written (a decode step's filler positions)."""
        self.filled -= n

    def place_rows(self, source: torch.Tensor, slots: torch.Tensor, key_mask: torch.Tensor) -> None:
        """Row i takes row source[i]'s positions slots[i] (rows, n) as its first n: each prompt's prefill
        copied to its rows, moved right by the row's own shift (see _shared_prefill). Allocates the rows'
        cache at full capacity, as the first append would."""
        assert self.k is not None and self.v is not None
        n = slots.shape[1]
        k = self.k.new_empty((len(source), self.capacity, *self.k.shape[2:]))
        v = self.v.new_empty((len(source), self.capacity, *self.v.shape[2:]))
        k[:, :n] = self.k[source[:, None], slots]
        v[:, :n] = self.v[source[:, None], slots]
        self.k, self.v, self.key_mask, self.filled = k, v, key_mask, n

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is None:  # values may be narrower than keys (DeepSeek-V3's v_head_dim)
            self.k = k.new_empty((k.shape[0], self.capacity, *k.shape[2:]))
            self.v = v.new_empty((v.shape[0], self.capacity, *v.shape[2:]))
        assert self.v is not None
        end = self.filled + k.shape[1]
        self.k[:, self.filled : end] = k
        self.v[:, self.filled : end] = v
        self.filled = end
        return self.k[:, :end], self.v[:, :end]


class StaticKVCache(KVCache):
    """objective.generation_compile: a block's keys and values for all `capacity` positions, attended whole
    (the unwritten ones masked), the new positions written at `pos` (a one-element tensor every block
    shares, advanced by the decoder). No shape and no Python number changes from one decode step to the
    next, so the step compiles once and a CUDA graph can replay it."""

    static = True

    def __init__(self, capacity: int, key_mask: torch.Tensor, pos: torch.Tensor) -> None:
        super().__init__()
        self.capacity, self.key_mask, self.pos = capacity, key_mask, pos
        self.key_pos = torch.arange(capacity, device=key_mask.device)

    def update(
        self, k: torch.Tensor, v: torch.Tensor, window: Optional[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.k is None:  # at the prefill (eager), before any compiled step; values may be narrower than keys
            self.k = k.new_zeros((k.shape[0], self.capacity, *k.shape[2:]))
            self.v = v.new_zeros((v.shape[0], self.capacity, *v.shape[2:]))
        assert self.v is not None
        written = self.pos + torch.arange(k.shape[1], device=k.device)
        self.k.index_copy_(1, written, k)
        self.v.index_copy_(1, written, v)
        q, kpos = written[:, None], self.key_pos[None, :]
        seen = kpos <= q
        if window is not None:
            seen &= kpos > q - window
        # Each query sees itself, so a padding row is never empty (SDPA would return NaN): as padded_keys.
        mask = (seen & self.key_mask[:, None, None, :]) | (kpos == q)
        return self.k, self.v, mask


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off


@dataclass
class Generated:
    completions: list[list[int]]  # each row's new ids, its stop id included when it stopped
    truncated: list[bool]  # no stop id within max_new_tokens
    # Mean entropy (nats) of the distribution each new token was sampled from, before top-k / top-p, at the
    # temperature (TRL's GRPO "entropy": logits / temperature over the completion tokens).
    entropy: float = 0.0
    # generate_batch(sampler_logps=True): each new token's log-prob under the distribution it was drawn from
    # (logits / temperature, after top-k and top-p: vLLM's processed log-probs, what TRL's importance-sampling
    # correction compares the training policy with), one list per row, as long as its completion.
    logps: Optional[list[list[float]]] = None


def sample_next(logits: torch.Tensor, s: Sampling, generator: Optional[torch.Generator]) -> torch.Tensor:
    """(rows, vocab) fp32 logits -> (rows,) next ids."""
    if s.temperature <= 0:
        return logits.argmax(dim=-1)
    return _draw(logits / s.temperature, s, generator)


def _draw(logits: torch.Tensor, s: Sampling, generator: Optional[torch.Generator]) -> torch.Tensor:
    """Ids drawn from logits already divided by the temperature: top-k, top-p, then the draw."""
    return _sample(_processed(logits, s), generator)


def _processed(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """Logits (already divided by the temperature) with top-k's and top-p's excluded ids at -inf."""
    if 0 < s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1)  # ascending, as transformers' TopPLogitsWarper
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - s.top_p
        drop[:, -1] = False  # the most likely token always stays
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return logits


def _sample(logits: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """One id per row drawn from softmax(logits)."""
    return _sample_probs(logits.softmax(dim=-1), generator)


def _sample_probs(probs: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """One id per row drawn from `probs` (rows, vocab), each row a softmax."""
    # Inverse CDF: one uniform per row against the cumulative probabilities (in float64: a long vocabulary's
    # sums stay exact to ~1e-16), the categorical distribution itself, drawn with `rows` random numbers where
    # torch.multinomial draws rows x vocab exponentials (10x the time on CPU for 32 x 256). The first id whose
    # cumulative sum passes the draw has a positive probability: the draw stays below the total.
    cum = probs.double().cumsum(dim=-1)
    total = cum[:, -1:]
    u = torch.rand(total.shape, generator=generator, device=probs.device, dtype=torch.float64)
    draw = torch.minimum(u * total, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cum, draw, right=True).squeeze(1)


def generate_batch(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    s: Sampling,
    stop_ids: Iterable[int],
    pad_id: int = 0,
    generator: Optional[torch.Generator] = None,
    all_done: Optional[Callable[[torch.Tensor], bool]] = None,
    sequence_multiple: int = 1,
    compiled: bool = False,
    limits: Optional[Sequence[int]] = None,
    plain: bool = False,
    sampler_logps: bool = False,
    shared: Optional[Sequence[int]] = None,
) -> Generated:
    """Completions of `prompts` (token ids) from `model` (a dtlaunch decoder whose RoPE tables cover the
    longest prompt + max_new_tokens: dtlaunch.infer.generate.set_positions). `all_done(done)`: whether
    decoding may stop, given this batch's finished rows; a sharded model's ranks must run the same number
    of decode steps (each forward gathers weights collectively), so they agree on it there.
    `sequence_multiple`: every forward's positions a multiple of it (sequence parallel: the TP degree).
    `compiled`: the decode steps run compiled against static caches (`decode_step`); the prefill eagerly.
    `limits`: each row's own cap on new tokens (<= s.max_new_tokens; a tool-calling continuation's room
    left in max_completion_length): the row ends there, truncated, and never reaches a position past it.

    Rows with the same prompt (GRPO's G completions of a prompt) share its prefill: each distinct prompt
    runs through the model once and its keys and values are copied to its rows. `shared`: each row's leading
    tokens that rows may share (a multi-turn continuation: the original prompt, before the row's own turns
    and tool results); each distinct such prefix runs once and only the rows' own tokens after it are
    prefilled per row (_shared_prefill), on models whose blocks all decode with keys and values. Rows that finished leave
    the decode batch (their caches' rows dropped) once a quarter of it has, eager decoding only (compiled
    steps keep their shapes). The sampler still draws for every row, finished or not, from logits of the
    same values: the generator's stream, and so every row's tokens, are those of `plain=True` (every row
    prefilled and decoded to the end), which the tests compare against."""
    args = (model, prompts, s, stop_ids, pad_id, generator, all_done, sequence_multiple, compiled, limits, plain)
    with _without_autograd(model):
        return _generate_batch(*args, sampler_logps, shared)


def _without_autograd(model: torch.nn.Module) -> Any:
    """torch.inference_mode when every parameter is a plain tensor: a decode step is hundreds of small ops,
    and inference mode skips their version counters and view tracking (~12 % of a step on CPU at the
    bench's size, tokens unchanged). Tensor subclasses (FSDP's and tensor parallel's DTensors, NF4 weights)
    may keep what a forward makes (an unsharded weight), which must stay usable by training's autograd:
    no_grad for them. Nothing made here outlives the call (the result is Python lists)."""
    plain = all(type(p) is torch.nn.Parameter or type(p) is torch.Tensor for p in model.parameters())
    return torch.inference_mode() if plain else torch.no_grad()


def _generate_batch(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    s: Sampling,
    stop_ids: Iterable[int],
    pad_id: int,
    generator: Optional[torch.Generator],
    all_done: Optional[Callable[[torch.Tensor], bool]],
    sequence_multiple: int,
    compiled: bool,
    limits: Optional[Sequence[int]],
    plain: bool,
    sampler_logps: bool,
    shared: Optional[Sequence[int]],
) -> Generated:
    # Every forward here gets the logits (the model's `head` argument left at its default): the training
    # loss's chunked form (training.loss_chunks) is asked for by the loss's own callers, per call.
    device = next(model.parameters()).device
    m = sequence_multiple
    rows = len(prompts)
    split = None
    # A row that is all prefix (or none) has nothing of its own to prefill: every row prefilled whole then.
    if shared is not None and not (plain or compiled):
        if all(0 < k < len(p) for p, k in zip(prompts, shared, strict=True)):
            split = _Split.of(prompts, shared, m)
    longest = split.width if split is not None else round_up(max(len(p) for p in prompts), m)
    capacity = longest + s.max_new_tokens + m - 1
    firsts: dict[tuple[int, ...], int] = {}
    whole_rows = prompts if split is None else split.prefixes
    source = list(range(rows)) if plain else [firsts.setdefault(tuple(p), len(firsts)) for p in whole_rows]
    distinct = prompts if plain else [list(p) for p in firsts]
    first_width = longest if split is None else split.prefix_width
    tokens = torch.full((len(distinct), first_width), pad_id, dtype=torch.long, device=device)
    key_mask = torch.zeros(len(distinct), capacity, dtype=torch.bool, device=device)
    for i, p in enumerate(distinct):
        tokens[i, first_width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        key_mask[i, first_width - len(p) : first_width] = True
    lengths = key_mask[:, :first_width].sum(dim=1)
    positions = (key_mask[:, :first_width].long().cumsum(dim=1) - 1).clamp(min=0)
    pos = torch.zeros(1, dtype=torch.long, device=device)  # compiled decoding: the static caches' next position
    masks: dict[Optional[int], torch.Tensor] = {}
    # A family may decode some blocks with a state of its own (model.decoding_cache: Qwen3-Next's linear blocks).
    preallocated = (
        []
        if compiled
        else [model.decoding_cache(key, PreallocatedKVCache(capacity, key_mask, masks)) for key in model.layers]
    )
    if split is not None and not all(isinstance(c, PreallocatedKVCache) for c in preallocated):
        # A recurrent state cannot take a prefix moved to other positions: every row prefilled whole.
        return _generate_batch(
            model, prompts, s, stop_ids, pad_id, generator, all_done, m, compiled, limits, plain, sampler_logps, None
        )
    static = [StaticKVCache(capacity, key_mask, pos) for _ in model.layers] if compiled else []
    caches: list[KVCache] = [*preallocated, *static]
    step_fn = decode_step(model) if compiled else model
    stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    out = torch.full((rows, s.max_new_tokens), pad_id, dtype=torch.long, device=device)
    cap = torch.tensor(list(limits) if limits is not None else [s.max_new_tokens] * rows, device=device)
    n = 0
    entropy = torch.zeros((), device=device)
    taken = torch.zeros(rows, s.max_new_tokens, device=device) if sampler_logps else None
    logits = _whole(model(tokens, positions=positions, caches=caches, last_only=True)[:, -1]).float()
    if split is not None:  # the rows' own tokens after their prefix's prefill
        index = torch.tensor(source, device=device)
        key_mask, lengths, logits = _shared_prefill(model, split, index, preallocated, masks, pad_id, capacity)
    elif len(distinct) < rows:  # each row's copy of its prompt's prefill
        index = torch.tensor(source, device=device)
        key_mask, lengths, logits = key_mask[index], lengths[index], logits[index]
        for cache in caches:  # the prefill's own cache, a row per distinct prompt, is freed once copied
            cache.select_rows(index, key_mask)
    live: Optional[torch.Tensor] = None  # the rows still in the decode batch, once some left it; None: all
    if compiled:
        pos += longest
    # Each step's positions, a row past its cap held at its last one (read by nothing, in RoPE's range).
    steps = torch.arange(s.max_new_tokens, device=device)[:, None]
    held_at = lengths + torch.minimum(cap - 1, steps)  # (max_new_tokens, rows)
    capped = cap <= steps + 1  # (max_new_tokens, rows): a row at its cap after step n
    one_stop = int(stops[0]) if len(stops) == 1 else None
    for n in range(s.max_new_tokens):
        # Dividing by a temperature of 1 changes no bit: skipped (one op fewer per step).
        scaled = logits / s.temperature if s.temperature > 0 and s.temperature != 1 else logits
        processed = _processed(scaled, s) if s.temperature > 0 else scaled
        probs = processed.softmax(dim=-1) if s.temperature > 0 else None
        going, lp = (~done, scaled) if live is None else ((~done)[live], scaled[live])
        lp = torch.log_softmax(lp, dim=-1)
        # The entropy's probabilities: the sampler's own where they are exp(lp)'s (no top-k / top-p, every row).
        same = probs is not None and processed is scaled and live is None
        entropy -= (((probs if same else lp.exp()) * lp).sum(-1) * going).sum()  # the rows still generating
        nxt = _sample_probs(probs, generator) if probs is not None else logits.argmax(dim=-1)
        if taken is not None:  # the drawn token's log-prob under the distribution it was drawn from
            drawn_lp = lp if processed is scaled and live is None else torch.log_softmax(processed, dim=-1)
            taken[:, n] = drawn_lp.gather(1, nxt[:, None])[:, 0]
        nxt = nxt.masked_fill(done, pad_id)
        out[:, n] = nxt
        stopped = nxt == one_stop if one_stop is not None else torch.isin(nxt, stops)
        done = done | stopped | capped[n]
        finished = all_done(done) if all_done is not None else bool(done.all())
        if finished or n == s.max_new_tokens - 1:
            break
        key_mask[:, longest + n] = True  # a finished row's later tokens are never read back
        if not (compiled or plain):
            live, key_mask = _drop_finished(live, done, key_mask, preallocated)
        fed, at = (nxt, held_at[n]) if live is None else (nxt[live], held_at[n][live])
        step, at = fed.unsqueeze(1), at.unsqueeze(1)
        if m > 1:
            step, at = step.expand(-1, m), at.expand(-1, m)
        masks.clear()
        new = _whole(step_fn(step, positions=at, caches=caches)[:, 0]).float()
        # The finished rows keep their last logits: drawn from and discarded, as in the plain path.
        logits = new if live is None else logits.index_copy(0, live, new)
        # The next step writes over this one's fillers (sequence parallel): one position on.
        if compiled:
            pos += 1
        elif m > 1:
            for cache in preallocated:
                cache.drop_last(m - 1)
    stop_set = set(stops.tolist())
    completions, truncated = [], []
    for row, row_cap in zip(out[:, : n + 1].tolist(), cap.tolist(), strict=True):
        row = row[:row_cap]
        end = next((j + 1 for j, t in enumerate(row) if t in stop_set), None)
        completions.append(row[:end] if end is not None else row)
        truncated.append(end is None)
    tokens_out = sum(len(c) for c in completions)
    logps = None
    if taken is not None:
        logps = [values[: len(c)] for values, c in zip(taken[:, : n + 1].tolist(), completions, strict=True)]
    return Generated(completions, truncated, float(entropy) / max(tokens_out, 1), logps)


def round_up(n: int, m: int) -> int:
    """`n` rounded up to a multiple of `m` (sequence parallel's positions per forward)."""
    return -(-n // m) * m


@dataclass(frozen=True)
class _Split:
    """Rows cut into a prefix they may share and their own suffix, and the prefill's layout: every row ends
    at slot `width`, its suffix just before, its prefix just before that (left padding first), so that the
    positions between a row's real tokens are their distances (sliding windows count slots)."""

    prefixes: list[list[int]]
    suffixes: list[list[int]]
    prefix_width: int  # the first prefill's width: the longest prefix, a multiple of m
    width: int  # prefix_width + the longest suffix, rounded to m

    @classmethod
    def of(cls, prompts: Sequence[Sequence[int]], shared: Sequence[int], m: int) -> _Split:
        prefixes = [list(p[:k]) for p, k in zip(prompts, shared, strict=True)]
        suffixes = [list(p[k:]) for p, k in zip(prompts, shared, strict=True)]
        prefix_width = round_up(max(len(p) for p in prefixes), m)
        return cls(prefixes, suffixes, prefix_width, prefix_width + round_up(max(len(x) for x in suffixes), m))


def _shared_prefill(
    model: torch.nn.Module,
    split: _Split,
    source: torch.Tensor,
    caches: list[PreallocatedKVCache],
    masks: dict[Optional[int], torch.Tensor],
    pad_id: int,
    capacity: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """After each distinct prefix's prefill (its tokens ending at slot P = split.prefix_width), every row
    gets its prefix's keys and values moved right by its shift (the longest suffix less its own), so that its
    prefix + suffix end at split.width; then one forward over slots [P, width) fills the rest: each row's
    suffix, after the last `shift` tokens of its prefix computed again (they see the same keys before them,
    so they get the values the prefill gave them). Returns the rows' key mask, lengths and last logits."""
    device = source.device
    p_width, width = split.prefix_width, split.width
    plen = torch.tensor([len(p) for p in split.prefixes], device=device)
    slen = torch.tensor([len(x) for x in split.suffixes], device=device)
    shift = (width - p_width) - slen
    slots = torch.arange(width, device=device)[None, :]
    key_mask = torch.zeros(len(source), capacity, dtype=torch.bool, device=device)
    key_mask[:, :width] = slots >= (width - slen - plen)[:, None]
    # Slot t < P of a row holds its prefix's slot t - shift (a padding slot, masked, where that is before 0).
    moved = (slots[:, :p_width] - shift[:, None]).clamp(min=0)
    for cache in caches:
        cache.place_rows(source, moved, key_mask)
    # Slots [P, width): each row's tokens there, its whole sequence ending at `width`.
    tokens = torch.full((len(source), width - p_width), pad_id, dtype=torch.long)
    for i, (p, x) in enumerate(zip(split.prefixes, split.suffixes, strict=True)):
        seq = p + x
        tail = seq[max(0, len(seq) - (width - p_width)) :]
        tokens[i, tokens.shape[1] - len(tail) :] = torch.tensor(tail, dtype=torch.long)
    positions = (key_mask[:, :width].long().cumsum(dim=1) - 1).clamp(min=0)[:, p_width:]
    masks.clear()
    out = model(tokens.to(device), positions=positions, caches=caches, last_only=True)
    return key_mask, plen + slen, _whole(out[:, -1]).float()


def _drop_finished(
    live: Optional[torch.Tensor], done: torch.Tensor, key_mask: torch.Tensor, caches: list[PreallocatedKVCache]
) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """The decode batch without its finished rows, once they are a quarter of it (each drop copies the
    caches); one row stays when all finished (a rank whose peers still decode keeps taking part)."""
    going = ~done if live is None else ~done[live]
    left = int(going.sum())
    if left * 4 > len(going) * 3 or len(going) == 1:
        return live, key_mask
    keep = going.nonzero().squeeze(1) if left else going.new_zeros(1, dtype=torch.long)  # places in the batch
    key_mask = key_mask.index_select(0, keep)
    for cache in caches:
        cache.keep_rows(keep, key_mask)
    return (keep if live is None else live[keep]), key_mask


def _whole(logits: torch.Tensor) -> torch.Tensor:
    """The logits over the whole vocabulary: tensor parallel's head leaves them a DTensor sharded on it."""
    full = getattr(logits, "full_tensor", None)
    return full() if full is not None else logits


def decode_step(model: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """`model`'s forward compiled for decoding (objective.generation_compile): shapes fixed (dynamic=False),
    and on CUDA captured as CUDA graphs ("reduce-overhead"), so a step replays one graph instead of launching
    every kernel from Python. Compiled once per model; later rollouts reuse it (the caches' tensors are
    inputs, checked by shape)."""
    compiled = _DECODE_STEPS.get(model)
    if compiled is None:
        cuda = next(model.parameters()).device.type == "cuda"
        compiled = torch.compile(model, dynamic=False, mode="reduce-overhead" if cuda else None)
        _DECODE_STEPS[model] = compiled
    return compiled


# Not an attribute of the model: a module assigned to a module becomes its submodule (and its state_dict's).
_DECODE_STEPS: weakref.WeakKeyDictionary[torch.nn.Module, Callable[..., torch.Tensor]] = weakref.WeakKeyDictionary()
