"""Log-probabilities in OpenAI's shapes, for the HTTP API (controller.http_form).

The last stage reports each token's log-probability and the most likely tokens at its position
(sampling.TokenLogprob: log-softmax of the raw logits, the model's own distribution, before
temperature, top-k, top-p and penalties); here they get their text:

    chat:         choices[].logprobs = {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}
    completions:  choices[].logprobs = {tokens, token_logprobs, top_logprobs: [{text: logprob}], text_offset}

A token's `bytes` are its exact bytes (a byte-level BPE token may hold part of a UTF-8
character); its text is them decoded, a partial character as U+FFFD.
"""
from __future__ import annotations

from logicpipe.sampling import TokenLogprob


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> the byte it stands for."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


class TokenText:
    """Each token id's bytes and text, worked out once (`tokenizer` None: the id itself as text)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._bytes: dict[int, bytes] = {}
        self._decoder = byte_decoder()

    def bytes(self, token_id: int) -> bytes:
        got = self._bytes.get(token_id)
        if got is None:
            got = self._bytes[token_id] = self._bytes_of(token_id)
        return got

    def _bytes_of(self, token_id: int) -> bytes:
        if self.tokenizer is None:
            return str(token_id).encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece and all(ch in self._decoder for ch in piece):  # byte-level BPE
            return bytes(self._decoder[ch] for ch in piece)
        return self.tokenizer.decode([token_id]).encode()  # others (SentencePiece): its decoded text

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")

    def chat(self, token_ids, logprobs) -> list[dict]:
        """OpenAI chat's logprobs.content entries of these tokens."""
        out = []
        for t, lp in zip(token_ids, logprobs):
            top = lp.top if lp is not None else ()
            out.append({**self._entry(t, lp.logprob if lp is not None else None),
                        "top_logprobs": [self._entry(i, v) for i, v in top]})
        return out

    def _entry(self, token_id: int, logprob: float | None) -> dict:
        return {"token": self.text(token_id), "logprob": logprob, "bytes": list(self.bytes(token_id))}

    def echoed(self, prompt_ids, prompt_logprobs) -> dict:
        """OpenAI completions' logprobs object of an echoed prompt: its first token has none (null),
        each other its logprob from the position before it."""
        lps = [None, *(prompt_logprobs or ())][:len(prompt_ids)]
        out = self.completions(prompt_ids, lps + [None] * (len(prompt_ids) - len(lps)))
        out["top_logprobs"][:1] = [None] * min(1, len(prompt_ids))
        return out

    def completions(self, token_ids, logprobs, offset: int = 0) -> dict:
        """OpenAI completions' logprobs object of these tokens (`offset`: the text's length before
        the first, for text_offset)."""
        texts = [self.text(t) for t in token_ids]
        offsets = []
        for s in texts:
            offsets.append(offset)
            offset += len(s)
        lps: list[TokenLogprob | None] = list(logprobs)
        return {"tokens": texts, "token_logprobs": [lp.logprob if lp is not None else None for lp in lps],
                "top_logprobs": [{self.text(i): v for i, v in (lp.top if lp is not None else ())} for lp in lps],
                "text_offset": offsets}
