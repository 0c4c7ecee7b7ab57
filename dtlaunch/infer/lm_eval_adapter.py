"""dtlaunch's own model inside lm-evaluation-harness, as torchtune's eleuther_eval does it: an HFLM whose
model calls go to the modules that train (loaded as `generate` loads them), so nothing is exported.

HFLM keeps everything that is not the model: tokenization with the run's Hugging Face tokenizer, chat
templates, request batching and reordering, rolling windows, continuation scoring and stop-sequence
post-processing. Only its constructor (which would load a transformers model) is replaced, and the
two model calls: the forward pass and generation. Imported only on the eval path (lm_eval is optional).
"""

from __future__ import annotations

from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import configure_pad_token

from dtlaunch.infer.batch_generate import Sampling, sample_next
from dtlaunch.infer.generate import Loaded, set_positions


class DtlaunchLM(HFLM):
    def __init__(self, loaded: Loaded, tokenizer: Any, device: torch.device, batch_size: int) -> None:
        TemplateLM.__init__(self)  # not HFLM.__init__: it would build a transformers model
        self._model = loaded.model
        self._config = None
        self.loaded = loaded
        self._device = device
        # Generation tasks: continuations produced, and those cut by the task's max length before an end token.
        self.generations, self.hit_max_length = 0, 0
        self.backend = "causal"
        self.tokenizer = configure_pad_token(tokenizer)
        self.vocab_size = self.tokenizer.vocab_size
        # HFLM's defaults for the settings dtlaunch does not expose.
        self.truncation = False
        self.logits_cache = True
        self.add_bos_token = None
        self.custom_prefix_token_id = None
        self.softmax_dtype = None
        self.mixed_precision_dtype = None
        self.think_end_token = None
        self.enable_thinking = None
        self.chat_template_args: dict[str, Any] = {}
        self.batch_size_per_gpu = batch_size
        self.batch_schedule = 1
        self.batch_sizes: dict = {}
        self.max_batch_size = batch_size
        self._rank, self._world_size = 0, 1
        # The context the model was built for (model.max_seq_len, config.json's max_position_embeddings on
        # an export): the same window HFLM gives the exported model, so rolling windows split alike.
        self._max_length = int(loaded.m.max_seq_len)
        self.pretrained = loaded.source
        self.peft = self.delta = None
        self.revision = None
        set_positions(self._model, self._max_length)

    def get_model_info(self) -> dict:
        # HFLM's version asks the hub for the model's revision; a local model has none.
        params = sum(p.numel() for p in self._model.parameters())
        return {"model_num_parameters": params, "model_dtype": str(next(self._model.parameters()).dtype)}

    def _model_call(self, inps: torch.Tensor, attn_mask: Any = None, labels: Any = None) -> torch.Tensor:
        # Causal only: HFLM pads on the right, which a causal model's earlier positions never see.
        with torch.no_grad():
            return self._model(inps)

    @torch.no_grad()
    def _model_generate(
        self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs: Any
    ) -> torch.Tensor:
        """Row by row with a KV cache: the batch comes left-padded and our attention takes no padding
        mask, so each row runs on its own tokens. Returns HFLM's layout: the padded context, then the new
        tokens, padded on the right; each row stops at EOS, at a stop string, or at `max_length`."""
        mask = generation_kwargs.pop("attention_mask", None)
        # transformers' rules, which HFLM's generate follows: sampling only with do_sample (temperature
        # 1 unless given); otherwise greedy, whatever the temperature.
        temperature = float(generation_kwargs.get("temperature", 1.0)) if generation_kwargs.get("do_sample") else 0.0
        top_p = float(generation_kwargs.get("top_p") or 1.0)
        width = context.shape[1]
        rows = []
        for i in range(context.shape[0]):
            ids = context[i] if mask is None else context[i][mask[i].bool()]
            rows.append(self._generate_row(ids.tolist(), max_length - width, stop, temperature, top_p))
        pad = self.tokenizer.pad_token_id
        out = torch.full((context.shape[0], width + max(map(len, rows), default=0)), pad, dtype=torch.long)
        out[:, :width] = context.cpu()
        for i, new in enumerate(rows):
            out[i, width : width + len(new)] = torch.tensor(new, dtype=torch.long)
        return out

    def _generate_row(self, prompt: list[int], budget: int, stop: list[str], temperature: float, top_p: float) -> list:
        from dtlaunch.models.dense.model import KVCache

        caches = [self._model.decoding_cache(key, KVCache()) for key in self._model.layers]
        g = torch.Generator(device=self._device).manual_seed(0)
        x = torch.tensor([prompt], dtype=torch.long, device=self._device)
        new: list[int] = []
        ends = {self.loaded.eos_id, *self.loaded.stop_ids}  # EOS and every end-of-turn id (transformers')
        sampling = Sampling(budget, temperature, top_p)
        while len(new) < budget:
            logits = self._model(x, caches=caches)[0, -1].float()
            nxt = int(sample_next(logits[None], sampling, g)[0])
            new.append(nxt)
            if nxt in ends or any(s in self.tok_decode(new) for s in stop):
                break
            x = torch.tensor([[nxt]], dtype=torch.long, device=self._device)
        else:
            self.hit_max_length += 1
        self.generations += 1
        return new


def load_lm(source: str, device: torch.device, batch_size: int, adapter: str = "") -> DtlaunchLM:
    """SOURCE (hf:DIR, a run or a checkpoint) as generate loads it, with the tokenizer it trained with: the
    run's kept Hugging Face copy (RUN/tokenizer, with the run's chat template), DIR's own, or, for a run on
    the byte tokenizer, that tokenizer in Hugging Face form (dtlaunch.data.byte_hf_tokenizer)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from dtlaunch.data.tokenizer import BYTE_VOCAB, ByteTokenizer
    from dtlaunch.errors import InputError
    from dtlaunch.infer.generate import load_source

    loaded = load_source(source, device, adapter=adapter)
    if isinstance(loaded.tokenizer, ByteTokenizer):
        from dtlaunch.data.byte_hf_tokenizer import byte_hf_tokenizer

        if int(loaded.m.vocab_size) < BYTE_VOCAB:  # only a synthetic-data run can be this small
            raise InputError(
                f"eval {source}: the byte tokenizer's {BYTE_VOCAB} ids do not fit model.vocab_size="
                f"{loaded.m.vocab_size} (a run on synthetic data): evaluate a run trained on text"
            )
        return DtlaunchLM(loaded, byte_hf_tokenizer(), device, batch_size)
    tok_file = Path(loaded.tokenizer_file)
    if not tok_file.is_file():
        raise InputError(
            f"eval {source}: the model's tokenizer '{loaded.tokenizer_file}' is not a tokenizer.json; "
            f"lm-eval needs one: train with data.tokenizer=byte or data.tokenizer=<tokenizer.json>"
        )
    return DtlaunchLM(loaded, AutoTokenizer.from_pretrained(str(tok_file.parent)), device, batch_size)
