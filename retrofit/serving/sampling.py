"""Per-request sampling: temperature, top-k, top-p, seed, max tokens and stop strings."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """How one request picks its tokens.

    Args:
        temperature: 0 = greedy (argmax); otherwise logits are divided by it before sampling.
        top_p: nucleus sampling: keep the smallest set of tokens whose probability reaches ``top_p``.
        top_k: keep the ``top_k`` most likely tokens (0 = all).
        max_tokens: tokens to generate at most (>= 1).
        stop: strings that end the answer (not included in the text).
        seed: seed of the request's own generator (None = random); the same seed gives the same
            tokens whatever else the server is doing.
        ignore_eos: keep going after the end-of-sequence token.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = all tokens), got {self.top_k!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(int(seed) if seed is not None else int(torch.randint(0, 2**62, ()).item()))
    return g


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from ``logits`` ``[V]``."""
    if params.greedy:
        return int(logits.argmax())
    z = logits.float() / params.temperature
    if params.top_k and params.top_k < z.shape[-1]:
        kth = z.topk(params.top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    if params.top_p < 1.0:
        sz, si = z.sort(descending=True)
        p = sz.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop = (p.cumsum(-1) - p) >= params.top_p
        z = z.index_fill(0, si[drop], float("-inf"))
    probs = z.softmax(-1).cpu()
    return int(torch.multinomial(probs, 1, generator=generator))


class StopChecker:
    """Incremental detokenization with stop strings: ``push(token)`` returns the text that is safe to emit
    and whether a stop string ended the answer (text held back while it could be the start of a stop)."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tok = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.emitted = 0
        self.text = ""

    def push(self, token: int) -> tuple[str, bool]:
        self.ids.append(token)
        if self.tok is None:
            return "", False
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the next token
            return "", False
        self.text = text
        for s in self.stop:
            i = text.find(s, max(0, self.emitted - len(s)))
            if i >= 0:
                out = text[self.emitted : i] if i > self.emitted else ""
                self.emitted = max(self.emitted, i)
                self.text = text[:i]
                return out, True
        hold = 0
        for s in self.stop:  # the longest suffix of the text that starts a stop string
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        safe = len(text) - hold
        out = text[self.emitted : safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return out, False

    def flush(self) -> str:
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out
