"""transformers in process (``hf:<hub id or local folder>``): batched generation on CPU or GPU.

Requests with the same generation config are generated together, ``batch_size`` at a time,
left-padded. Stop strings are passed to ``generate`` (so a row stops early) and the text is then
cut at the first stop string (:func:`~agents.llm.common.truncate_at_stop`), as the OpenAI API
does. Temperature 0 is greedy; otherwise sampling with ``temperature``/``top_p``, seeded per
batch with the first request's seed (batched sampling is reproducible for the same batch, not
per request). ``torch`` and ``transformers`` are imported when the backend is built.

Prompts are sent as text (``chat_format="raw"``); chat messages (and prompts under ``"user"`` /
``"prefill"``) go through the tokenizer's chat template, and ``Completion.sent`` holds the text.
Token counts come from the tokenizer; nothing is cached across calls (``cached_tokens=0``).

Grounded decoding: rows with a ``constraint`` get a logits processor that masks every token whose
text would leave the constraint's language (:class:`agents.llm.grounding.TokenGrammar`: each token's
text is read once from the tokenizer, by decoding it after a fixed anchor token; special tokens
and partial UTF-8 pieces are never allowed), and allows end-of-sequence once the text is
complete. The completion text of such a row is the concatenation of those token texts, exactly
what was checked.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from agents.llm.base import ActionConstraint, Completion, GenerationConfig, Request, SpecError
from agents.llm.common import (
    CONTINUE_INSTRUCTION,
    check_chat_format,
    messages_as_dicts,
    opt_bool,
    opt_int,
    prompt_as_messages,
    require,
    sampling_dict,
    truncate_at_stop,
)
from agents.llm.grounding import TokenGrammar


def token_texts(tokenizer: Any) -> list[str | None]:
    """The text each token adds after other text (None: special, or not text on its own)."""
    anchor_ids = list(tokenizer.encode("a", add_special_tokens=False))
    anchor = tokenizer.decode(anchor_ids, clean_up_tokenization_spaces=False)
    special = set(tokenizer.all_special_ids)
    special |= {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    decoded = tokenizer.batch_decode(
        [[*anchor_ids, i] for i in range(len(tokenizer))],
        skip_special_tokens=False,
        clean_up_tokenization_spaces=False,
    )
    out: list[str | None] = []
    for i, text in enumerate(decoded):
        piece = text[len(anchor) :] if text.startswith(anchor) else ""
        out.append(piece if piece and i not in special and "\ufffd" not in piece else None)
    return out


class _Grounded:
    """A logits processor: each constrained row may only continue inside its constraint."""

    def __init__(
        self,
        torch: Any,
        grammar: TokenGrammar,
        constraints: Sequence[ActionConstraint | None],
        newline: bool,
        width: int,
        n: int,
    ) -> None:
        self.torch, self.grammar, self.constraints = torch, grammar, constraints
        self.newline, self.width, self.n = newline, width, n
        self.ends = set(grammar.stop_ids)
        self.masks: dict[int, tuple[list[int], Any]] = {}  # long lists -> their index tensors

    def _index(self, allowed: list[int]) -> Any:
        if len(allowed) < 1024:
            return self.torch.tensor(allowed, dtype=self.torch.long)
        # a thought's list is the same object every step (TokenGrammar.free_text); the entry
        # holds the list itself, so its id cannot be reused by another list meanwhile
        found = self.masks.get(id(allowed))
        if found is None or found[0] is not allowed:
            found = (allowed, self.torch.tensor(allowed, dtype=self.torch.long))
            self.masks[id(allowed)] = found
        return found[1]

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        for row in range(scores.shape[0]):
            constraint = self.constraints[row // self.n]
            generated = input_ids[row, self.width :].tolist()
            if constraint is None or self.ends.intersection(generated):
                continue  # free, or finished at an end-of-sequence token (then padded)
            text = "".join(self.grammar.texts[i] or "" for i in generated)
            allowed = self.grammar.allowed(constraint, text, newline=self.newline)
            keep = self._index(allowed or self.grammar.stop_ids)
            mask = self.torch.full_like(scores[row], float("-inf"))
            mask[keep.to(scores.device)] = 0.0
            scores[row] = scores[row] + mask
        return scores


class HFBackend:
    """A causal LM from transformers. See the module docstring."""

    grounding = "transformers logits processor over token texts"  # enforces ActionConstraint

    def __init__(
        self,
        model: str,
        *,
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int | str = 8,
        chat_format: str = "raw",
        chat_instruction: str = CONTINUE_INSTRUCTION,
        trust_remote_code: bool | str = False,
        name: str | None = None,
    ) -> None:
        who = "hf"
        if not model:
            raise SpecError("hf needs a model: use hf:<hub id or local folder>")
        self.model_id = model
        self.name = name or f"hf:{model}"
        self.batch_size = opt_int(who, "batch_size", batch_size, 1)
        self.chat_format = check_chat_format(chat_format, allow_raw=True, backend=who)
        self.chat_instruction = chat_instruction
        remote = opt_bool(who, "trust_remote_code", trust_remote_code)
        self._torch = require("torch", "torch", "hf")
        transformers = require("transformers", "transformers", "hf")
        self._transformers = transformers
        torch = self._torch
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = device
        self.dtype = dtype
        torch_dtype: Any = "auto" if dtype == "auto" else getattr(torch, dtype, None)
        if torch_dtype is None:
            raise SpecError(f"hf: dtype={dtype!r} is not a torch dtype (e.g. float32, bfloat16)")
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model, trust_remote_code=remote)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model, dtype=torch_dtype, trust_remote_code=remote
        ).to(device)
        self.model.eval()
        self._grammar: TokenGrammar | None = None

    def token_grammar(self) -> TokenGrammar:
        """The tokenizer's :class:`TokenGrammar` (built on the first constrained request)."""
        if self._grammar is None:
            ends = self.model.generation_config.eos_token_id
            ends = [ends] if isinstance(ends, int) else list(ends or [])
            ends.append(self.tokenizer.eos_token_id)  # not the pad token: generate goes on after it
            ends = [int(i) for i in ends if i is not None]
            self._grammar = TokenGrammar(token_texts(self.tokenizer), ends)
        return self._grammar

    def describe(self) -> dict[str, Any]:
        return {
            "spec": self.name,
            "backend": "hf",
            "model": self.model_id,
            "device": self.device,
            "dtype": self.dtype,
            "batch_size": self.batch_size,
            "chat_format": self.chat_format,
            "transformers_version": __import__("transformers").__version__,
            "torch_version": self._torch.__version__,
            "grounding": self.grounding,
        }

    def render(self, request: Request) -> tuple[str, bool]:
        """The text for the model, and whether it came from the chat template (which then
        holds the special tokens itself)."""
        if request.messages is None and self.chat_format == "raw":
            assert request.prompt is not None
            return request.prompt, False
        if request.messages is not None:
            messages, tail = messages_as_dicts(request.messages), ""
        elif self.chat_format == "user":
            messages = prompt_as_messages(request.prompt or "", "user", self.chat_instruction)
            tail = ""
        else:
            messages, tail = (
                [{"role": "user", "content": self.chat_instruction}],
                request.prompt or "",
            )
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            return str(text) + tail, True
        roles = {"system": "System", "user": "User", "assistant": "Assistant"}
        text = "\n".join(f"{roles[m['role']]}: {m['content']}" for m in messages)
        return text + "\nAssistant:" + (" " if tail else "") + tail, False

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        results: list[Completion | None] = [None] * len(requests)
        groups: dict[GenerationConfig, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(r.config, []).append(i)
        for config, indices in groups.items():
            for start in range(0, len(indices), self.batch_size):
                chunk = indices[start : start + self.batch_size]
                rendered = [self.render(requests[i]) for i in chunk]
                # a batch is tokenized one way: chat-templated rows already hold special tokens
                by_kind: dict[bool, list[int]] = {}
                for i, (_, templated) in zip(chunk, rendered, strict=True):
                    by_kind.setdefault(templated, []).append(i)
                texts = {i: t for i, (t, _) in zip(chunk, rendered, strict=True)}
                for templated, rows in by_kind.items():
                    batch = self._batch(
                        config, [texts[i] for i in rows], [requests[i] for i in rows], templated
                    )
                    for i, c in zip(rows, batch, strict=True):
                        results[i] = c
        return [c for c in results if c is not None]

    def _batch(
        self,
        config: GenerationConfig,
        texts: list[str],
        requests: list[Request],
        templated: bool = False,
    ) -> list[Completion]:
        torch = self._torch
        tok = self.tokenizer
        start = time.perf_counter()
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=not templated).to(
            self.device
        )
        kwargs: dict[str, Any] = {
            "max_new_tokens": config.max_tokens,
            "num_return_sequences": config.n,
            "pad_token_id": tok.pad_token_id,
        }
        if config.stop:
            kwargs["stop_strings"] = list(config.stop)
            kwargs["tokenizer"] = tok
        if config.temperature > 0:
            kwargs.update(do_sample=True, temperature=config.temperature, top_p=config.top_p)
            if config.seed is not None:
                torch.manual_seed(config.seed)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        constraints = [r.constraint for r in requests]
        grammar = self.token_grammar() if any(c is not None for c in constraints) else None
        if grammar is not None:
            width = enc["input_ids"].shape[1]
            grounded = _Grounded(torch, grammar, constraints, "\n" in config.stop, width, config.n)
            kwargs["logits_processor"] = self._transformers.LogitsProcessorList([grounded])
        with torch.no_grad():
            out = self.model.generate(**enc, **kwargs)
        latency = time.perf_counter() - start
        width = enc["input_ids"].shape[1]
        new = out[:, width:]
        eos = {tok.eos_token_id, tok.pad_token_id} - {None}
        completions = []
        for row in range(len(texts)):
            prompt_tokens = int(enc["attention_mask"][row].sum())
            outs = []
            for k in range(config.n):
                ids = new[row * config.n + k].tolist()
                n_gen = len(ids)
                while n_gen and ids[n_gen - 1] in eos:
                    n_gen -= 1
                hit_eos = n_gen < len(ids)
                if grammar is not None and constraints[row] is not None:
                    text = "".join(grammar.texts[i] or "" for i in ids[:n_gen])
                else:
                    text = tok.decode(ids[:n_gen], skip_special_tokens=True)
                text, hit = truncate_at_stop(text, config.stop)
                finish = "stop" if hit or hit_eos or n_gen < config.max_tokens else "length"
                outs.append((text, finish, n_gen + (1 if hit_eos else 0)))
            completions.append(
                Completion(
                    text=outs[0][0],
                    finish_reason=outs[0][1],
                    prompt_tokens=prompt_tokens,
                    completion_tokens=sum(o[2] for o in outs),
                    latency_s=latency,
                    sent={"prompt": texts[row], "sampling": sampling_dict(requests[row])},
                    alternatives=tuple(o[0] for o in outs[1:]),
                )
            )
        return completions

    def close(self) -> None:
        self.model = None
        if self.device.startswith("cuda"):
            self._torch.cuda.empty_cache()
