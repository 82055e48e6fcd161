"""Tokenizer helpers: prompt encoding, end-of-sequence ids, streaming detokenisation."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hetmesh.errors import CorruptModel, InvalidRequest
from hetmesh.partition.store import brief_error
from hetmesh.protocol.generate import CHAT_ROLES, check_messages

_REPLACEMENT = "\ufffd"


def load_tokenizer(model_dir: str | os.PathLike[str]) -> Any:
    """The model folder's tokenizer (``CorruptModel`` if it has none)."""
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError, KeyError) as exc:
        raise CorruptModel(f"{model_dir}: no usable tokenizer ({brief_error(exc)})") from exc


def encode_prompt(tokenizer: Any, prompt: str, *, chat: bool = False) -> list[int]:
    """Token ids for ``prompt``; with ``chat``, wrapped in the model's chat template."""
    if not prompt.strip():
        raise InvalidRequest("empty prompt")
    if chat:
        return encode_messages(tokenizer, [{"role": "user", "content": prompt}])
    return [int(i) for i in tokenizer.encode(prompt)]


def encode_messages(tokenizer: Any, messages: Any) -> list[int]:
    """Token ids of a conversation (``[{"role", "content"}, ...]``) through the chat
    template, ending with the assistant's turn to speak; ``InvalidRequest`` if malformed."""
    conversation = list(check_messages(messages))
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("the model has no chat template")
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    return [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]


def eos_token_ids(model_dir: str | os.PathLike[str], tokenizer: Any) -> set[int]:
    """Every id that ends a generation: generation config, model config, tokenizer."""
    found: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            found.update(_ids(value))
    found.update(_ids(getattr(tokenizer, "eos_token_id", None)))
    return found


def _ids(value: Any) -> Iterable[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


class TextStream:
    """Turns token ids into text deltas without splitting a multi-byte character.

    Decodes a short window of recent tokens and emits only the text that grew
    past what was already emitted; text ending in an incomplete UTF-8
    sequence (decoded as U+FFFD) is held back until later tokens complete it.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # window start: tokens before it are fully emitted
        self._read = 0  # tokens whose text has been emitted

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly "")."""
        self._ids.append(int(token_id))
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith(_REPLACEMENT):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is held back (at the end of a generation)."""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return after[len(before) :] if len(after) > len(before) else ""

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return str(self._tokenizer.decode(ids, skip_special_tokens=True))


class StopMatcher:
    """Cuts a text stream at the first stop sequence, holding back possible prefixes."""

    def __init__(self, stops: Iterable[str]) -> None:
        self._stops = tuple(stops)
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Text safe to emit now; sets ``stopped`` once a stop sequence appeared."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        self._pending += text
        hits = [i for i in (self._pending.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self._pending = self._pending[: min(hits)], ""
            return out
        hold = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(self._pending)), 0, -1):
                if self._pending.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        cut = len(self._pending) - hold
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def flush(self) -> str:
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out


__all__ = [
    "CHAT_ROLES",
    "StopMatcher",
    "TextStream",
    "encode_messages",
    "encode_prompt",
    "eos_token_ids",
    "load_tokenizer",
]
