"""Chat rows: render conversations with the tokenizer's chat template, keep assistant tokens.

A chat row is ``{"messages": [{"role": ..., "content": ...}, ...]}``. It becomes the token ids of
the rendered conversation and a loss mask that is 1 exactly on the tokens the assistant wrote
(its messages' content and the template's end-of-turn after it), so fine-tuning learns the
answers and not the prompts. The assistant tokens come from one of two sources:

- a template that marks them with ``{% generation %} ... {% endgeneration %}``: transformers'
  ``return_assistant_tokens_mask``;
- any other template: the conversation is rendered prefix by prefix. The assistant message
  ``k`` spans from the end of ``messages[:k]`` rendered with the generation prompt to the end of
  ``messages[:k + 1]``; a token is the assistant's when its characters overlap that span (as
  transformers marks generation spans). This needs each rendered prefix to be the start of the
  whole conversation's text; a template that rewrites earlier turns depending on later ones
  (one that drops earlier reasoning, say) is refused for that row, with the fix.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

__all__ = ["ChatError", "ChatRenderer", "is_chat", "check_messages"]

_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


class ChatError(ValueError):
    """A conversation that cannot be rendered or masked (the message says why and the fix)."""


def is_chat(value) -> bool:
    """Whether a JSON value is a conversation: a list of ``{"role", "content"}`` objects."""
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)


def check_messages(messages) -> None:
    """Refuse a conversation the renderer cannot use.

    Raises:
        ChatError: not a non-empty list of ``{"role": str, "content": str}``, or no assistant
            message (nothing would be trained on).
    """
    if not is_chat(messages):
        raise ChatError('expected a list of {"role": ..., "content": ...} messages')
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise ChatError(
                f'message {i} needs a string "role" and a string "content", got '
                f"{sorted(message)}"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatError(
            'the conversation has no "assistant" message: nothing in it would be trained on'
        )


def _template(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one renders conversations
        template = template.get("default")
    return template or ""


class ChatRenderer:
    """Token ids and assistant-only loss masks of conversations under one tokenizer.

    Raises:
        ChatError: the tokenizer has no chat template.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        template = _template(tokenizer)
        if not template:
            raise ChatError(
                f"the tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has no chat "
                "template: use a tokenizer saved with one (tokenizer.chat_template)"
            )
        #: Whether the template marks assistant tokens itself (``{% generation %}``).
        self.generation_tags = bool(_GENERATION_TAG.search(template))

    def encode(self, conversations: Sequence[list]) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(ids, loss_mask)`` per conversation (int64 and uint8 arrays of one length).

        Raises:
            ChatError: for the first conversation (``.index``) whose assistant tokens cannot be
                found.
        """
        if not conversations:
            return []
        if self.generation_tags:
            return self._tagged(conversations)
        return self._by_prefix(conversations)

    def _render(self, conversations, add_generation_prompt: bool) -> list[str]:
        return self.tokenizer.apply_chat_template(
            list(conversations), tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _tagged(self, conversations):
        out = self.tokenizer.apply_chat_template(
            list(conversations),
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        results = []
        for index, (ids, mask) in enumerate(
            zip(out["input_ids"], out["assistant_masks"], strict=True)
        ):
            mask = np.asarray(mask, dtype=np.uint8)
            if not mask.any():
                raise _at(
                    index,
                    "the chat template's {% generation %} blocks mark no token of this "
                    "conversation's assistant messages; put them around the assistant content",
                )
            results.append((np.asarray(ids, dtype=np.int64), mask))
        return results

    def _by_prefix(self, conversations):
        # One render call for every text needed: the whole conversations, then per assistant
        # message k the prefix up to it (with the generation prompt) and the prefix through it
        # (the whole conversation itself when k is the last message).
        wanted: list[tuple[list, bool]] = [(c, False) for c in conversations]
        owners = []  # (conversation, index of "before" in wanted, of "through" or None)
        for index, messages in enumerate(conversations):
            for k, message in enumerate(messages):
                if message["role"] != "assistant":
                    continue
                before_at, through_at = len(wanted), None
                wanted.append((messages[:k], True))
                if k + 1 < len(messages):
                    through_at = len(wanted)
                    wanted.append((messages[: k + 1], False))
                owners.append((index, before_at, through_at))
        texts = self._render_each(wanted)
        spans: list[list[tuple[int, int]]] = [[] for _ in conversations]
        for index, before_at, through_at in owners:
            full = texts[index]
            before = texts[before_at]
            through = full if through_at is None else texts[through_at]
            if not (full.startswith(through) and through.startswith(before)):
                raise _at(
                    index,
                    "the chat template does not render this conversation prefix by prefix (an "
                    "earlier turn reads differently once later messages follow), so its "
                    "assistant tokens cannot be located; mark the assistant content in the "
                    "template with {% generation %} ... {% endgeneration %}",
                )
            spans[index].append((len(before), len(through)))
        full = texts[: len(conversations)]
        results = []
        for index, (ids, token_spans) in enumerate(self._tokenize(full, spans)):
            mask = np.zeros(len(ids), dtype=np.uint8)
            for first, last in token_spans:
                mask[first:last] = 1
            if not mask.any():
                raise _at(index, "the assistant messages render to no tokens")
            results.append((ids, mask))
        return results

    def _tokenize(self, texts: list[str], spans: list[list[tuple[int, int]]]):
        """``(ids, [(first, end) token range per character span])`` per text: the tokens whose
        characters overlap each span (ids as ``tokenizer(text, add_special_tokens=False)``)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:  # a fast tokenizer: two lookups per span, no per-token work
            for encoding, text_spans in zip(
                backend.encode_batch(texts, add_special_tokens=False), spans, strict=True
            ):
                ranges = []
                for start, end in text_spans:
                    first, last = encoding.char_to_token(start), encoding.char_to_token(end - 1)
                    if first is None or last is None:  # a character no token covers
                        ranges = None
                        break
                    ranges.append((first, last + 1))
                if ranges is None:
                    ranges = _overlaps(np.asarray(encoding.offsets).reshape(-1, 2), text_spans)
                yield np.asarray(encoding.ids, dtype=np.int64), ranges
            return
        encoded = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        for ids, offsets, text_spans in zip(
            encoded["input_ids"], encoded["offset_mapping"], spans, strict=True
        ):
            offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
            yield np.asarray(ids, dtype=np.int64), _overlaps(offsets, text_spans)

    def _render_each(self, wanted: list[tuple[list, bool]]) -> list[str]:
        """Render ``(messages, add_generation_prompt)`` pairs, batched by the flag."""
        texts: list[str | None] = [None] * len(wanted)
        for flag in (False, True):
            where = [i for i, (_, f) in enumerate(wanted) if f is flag]
            rendered = self._render([wanted[i][0] for i in where], flag) if where else []
            for i, text in zip(where, rendered, strict=True):
                texts[i] = text
        return texts


def _overlaps(offsets: np.ndarray, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Token ranges whose character ``offsets`` overlap each span (as transformers marks
    generation spans)."""
    ranges = []
    for start, end in spans:
        hit = np.flatnonzero((offsets[:, 0] < end) & (offsets[:, 1] > start))
        if len(hit):
            ranges.append((int(hit[0]), int(hit[-1]) + 1))
    return ranges


def _at(index: int, message: str) -> ChatError:
    error = ChatError(message)
    error.index = index
    return error
