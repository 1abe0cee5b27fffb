"""Token ids of prompts that grow: an episode's prompt at one step is its previous prompt with
the step appended, so only the appended text needs tokenizing.

:class:`PrefixTokenizer` keeps, per key (an episode), the last prompt and its ids. When a new
prompt extends the kept one, the last ``overlap`` tokens of the kept ids are tokenized again
together with the appended text (a merge across the junction can only change tokens near it),
and the result is spliced on only if those ``overlap`` tokens come out unchanged; anything else
(a prompt that does not extend the kept one, a junction that moved, text whose kept tokens do
not decode back to it) is tokenized whole. ``check=True`` also tokenizes every spliced prompt
whole and uses, and counts, the whole tokenization where they differ: for measuring, not for
speed. Nothing here imports a tokenizer: it is given ``encode`` (the whole prompt, special
tokens included, as the engine would), ``encode_piece`` (no special tokens) and ``decode``.

:class:`EpisodePromptIds` applies it to requests, keyed by their episode: the vLLM backend sends
those ids instead of the text, so its frontend does not tokenize every step's whole prompt
(Gemma 3's 262k-token BPE over a prompt of a thousand tokens and more:
``benchmarks/bench_frontend.py`` measures the share).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agents.llm.base import Request


@dataclass(frozen=True)
class _Kept:
    text: str
    ids: tuple[int, ...]


class PrefixTokenizer:
    """See the module docstring. ``keep`` bounds the number of episodes remembered."""

    def __init__(
        self,
        encode: Callable[[str], Sequence[int]],
        encode_piece: Callable[[str], Sequence[int]],
        decode: Callable[[Sequence[int]], str],
        *,
        overlap: int = 8,
        keep: int = 1024,
        check: bool = False,
    ) -> None:
        self.encode = encode
        self.encode_piece = encode_piece
        self.decode = decode
        self.overlap = max(1, overlap)
        self.keep = max(1, keep)
        self.check = check
        self._kept: OrderedDict[str, _Kept] = OrderedDict()
        self.spliced = self.whole = self.mismatched = 0  # counts, for reports and tests

    def ids(self, key: str, text: str) -> list[int]:
        """The token ids of ``text``, the prompt of ``key``'s next step."""
        ids = self._splice(self._kept.get(key), text)
        if ids is None:
            self.whole += 1
            ids = list(self.encode(text))
        else:
            self.spliced += 1
            if self.check:
                full = list(self.encode(text))
                if full != ids:
                    self.mismatched += 1
                    ids = full
        self._kept[key] = _Kept(text, tuple(ids))
        self._kept.move_to_end(key)
        while len(self._kept) > self.keep:
            self._kept.popitem(last=False)
        return ids

    def forget(self, key: str) -> None:
        self._kept.pop(key, None)

    def _splice(self, kept: _Kept | None, text: str) -> list[int] | None:
        if kept is None or len(text) <= len(kept.text) or not text.startswith(kept.text):
            return None
        cut = len(kept.ids) - self.overlap
        if cut <= 0:
            return None
        tail = self.decode(kept.ids[cut:])
        if not tail or not kept.text.endswith(tail):
            return None  # e.g. special tokens, or bytes split across tokens
        redone = list(self.encode_piece(tail + text[len(kept.text) :]))
        if tuple(redone[: self.overlap]) != kept.ids[cut:]:
            return None
        return [*kept.ids[:cut], *redone]


class EpisodePromptIds:
    """The token ids to send an engine for a completion-style request whose call site names its
    episode, made with the engine's own tokenizer (``tokenizer()``: called once, on first use;
    it has Hugging Face's ``encode(text, add_special_tokens=...)`` and ``decode(ids)``), each
    episode's prompts of one purpose tokenized by what they append. None for any other
    request: send its text, the engine tokenizes it whole."""

    def __init__(self, tokenizer: Callable[[], Any], *, keep: int = 512) -> None:
        self._tokenizer = tokenizer
        self._keep = keep
        self._ids: PrefixTokenizer | None = None

    def __call__(self, request: Request) -> list[int] | None:
        if request.prompt is None or request.site.episode is None:
            return None
        if self._ids is None:
            tok = self._tokenizer()
            self._ids = PrefixTokenizer(
                lambda text: tok.encode(text),
                lambda text: tok.encode(text, add_special_tokens=False),
                lambda ids: str(tok.decode(list(ids))),
                keep=self._keep,
            )
        return self._ids.ids(f"{request.site.episode}|{request.purpose}", request.prompt)
