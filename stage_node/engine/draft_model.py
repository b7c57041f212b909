"""A draft model: a small causal LM with the model's tokenizer that drafts candidates greedily.

The alternative to prompt lookup (`stage_node.drafter`) for text that does not copy its input: the
last stage runs it on its runner thread after a step, k greedy tokens per sequence, and sends them
as candidates. Greedy drafts are a point-mass draft distribution, so the same verification keeps
greedy output exact and sampled output's distribution (and tokens) unchanged.

Any Hugging Face causal LM directory (safetensors) with the same vocabulary works; `layers` keeps
only its first N decoder layers, so the model itself can be its own drafter (self-speculation:
the early layers and the LM head guess, the whole pipeline checks). Each sequence keeps its draft
KV cache between steps; it is cut back to what the sequence really holds before drafting again.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

MAX_CACHED_SEQUENCES = 64  # draft KV caches kept (the least recently drafted for is dropped)


class DraftModelError(ValueError):
    """The draft model cannot be used (unreadable, or another vocabulary)."""


class DraftModel:
    def __init__(self, path: str | Path, *, layers: int = 0, device: str = "cpu", dtype: str = "float32"):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        path = Path(path)
        if not (path / "config.json").is_file():
            raise DraftModelError(f"draft model directory {path} has no config.json")
        try:
            config = AutoConfig.from_pretrained(path)
            full = config.num_hidden_layers
            if layers:
                if not 1 <= layers <= full:
                    raise DraftModelError(f"--draft-layers {layers}: the draft model has {full} layers")
                config.num_hidden_layers = layers
            self.model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=getattr(torch, dtype),
                                                              use_safetensors=True).to(device).eval()
        except DraftModelError:
            raise
        except Exception as exc:  # noqa: BLE001 — whatever transformers says, as one clear error
            raise DraftModelError(f"cannot load the draft model at {path}: {str(exc).splitlines()[0][:300]}") from exc
        self.path, self.layers, self.device = path, config.num_hidden_layers, device
        self.vocab_size = config.vocab_size
        self._caches: OrderedDict[str, tuple[object, list[int]]] = OrderedDict()  # seq -> (cache, its tokens)
        self._lock = threading.Lock()  # propose runs on the runner thread, forget on the event loop

    def describe(self) -> str:
        return f"model {self.path.name} ({self.layers} layers)"

    def propose(self, seq_id: str, context: Sequence[int], k: int) -> list[int]:
        """k greedy tokens after `context` (runner thread)."""
        import torch
        from transformers import DynamicCache

        if k <= 0 or not context:
            return []
        with torch.inference_mode():
            with self._lock:
                cache, have = self._caches.pop(seq_id, (None, []))
            common = 0
            limit = min(len(have), len(context) - 1)  # at least the last token is fed again
            while common < limit and have[common] == context[common]:
                common += 1
            if cache is None or common == 0:
                cache, common = DynamicCache(config=self.model.config), 0
            elif cache.get_seq_length() > common:
                cache.crop(common - cache.get_seq_length())  # negative: positions to drop (any transformers)
            ids = torch.tensor([list(context[common:])], device=self.device)
            out = self.model(ids, past_key_values=cache, use_cache=True)
            drafts: list[int] = []
            for i in range(k):
                drafts.append(int(out.logits[0, -1].argmax()))
                if i < k - 1:
                    out = self.model(torch.tensor([[drafts[-1]]], device=self.device), past_key_values=cache,
                                     use_cache=True)
            with self._lock:
                self._caches[seq_id] = (cache, list(context) + drafts[:-1])
                while len(self._caches) > MAX_CACHED_SEQUENCES:
                    self._caches.popitem(last=False)
            return drafts

    def forget(self, keep: set[str]) -> None:
        """Drop the caches of sequences not in `keep` (closed ones)."""
        with self._lock:
            for sid in [s for s in self._caches if s not in keep]:
                self._caches.pop(sid, None)

    def cached(self) -> list[str]:
        """The sequences whose draft KV is kept."""
        with self._lock:
            return list(self._caches)
