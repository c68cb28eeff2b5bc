"""Instruction data: records of prompt/completion pairs or chats, tokenized with a loss mask.

Formats (``--data.format``):

- ``prompt_completion``: fields ``prompt`` and ``completion`` (names configurable). The sample is
  ``[bos] + encode(prompt) + encode(completion) + [eos]``, prompt and completion tokenized apart,
  so the boundary between them is exact.
- ``chat``: a field ``messages``, a list of ``{"role", "content"}``, rendered by the tokenizer's own
  ``apply_chat_template``. A role must be one the template knows (:func:`template_roles`: system,
  user, assistant, tool, and any role the template compares a message's role with); another
  (a typo'd ``"asistant"``) is refused with its file and line, never trained on. The assistant
  turns are found by rendering the conversation a turn at a time: turn ``j`` is the text between
  ``render(messages[:j], add_generation_prompt=True)`` and ``render(messages[:j + 1])`` (its
  content and the template's end-of-turn marker), and the tokens of the whole rendering that lie
  in it (by the fast tokenizer's character offsets) are the assistant's. A template that does not render a conversation
  prefix by prefix is refused.

**Loss mask** (``train_on``): ``"completion"`` (the default) learns only the completion, or the
assistant turns; ``"prompt"`` learns every token. A sample of ``n`` tokens gives
``inputs = tokens[:-1]`` and ``targets = tokens[1:]`` with ``-100`` at every target not learned,
both cut to ``seq_len``. A sample left with no target to learn (its prompt alone fills the
context) is dropped and counted: nothing trains on zero targets silently.

The result of one sample is a :data:`Piece`: an int64 array ``[2, n]`` of inputs and targets
(:mod:`shardwise.data.batching` pads or packs them into batches). ``transformers`` is not imported:
the tokenizer is passed in (any object with ``encode``, ``eos_token_id``, and for chats
``apply_chat_template`` and offsets from ``__call__``).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardwise.data.records import Record
from shardwise.errors import ConfigError

FORMATS = ("text", "prompt_completion", "chat")
TRAIN_ON = ("completion", "prompt")
IGNORE_INDEX = -100
Piece = np.ndarray  # int64 [2, n]: inputs, targets (-100: not learned)
STANDARD_ROLES = frozenset({"system", "user", "assistant", "tool"})
_ROLE = r"""role['"]?\]?"""  # message['role'], message["role"], message.role
_ROLE_COMPARED = re.compile(_ROLE + r"""\s*[!=]=\s*['"]([A-Za-z_][\w-]*)['"]""")
_COMPARED_ROLE = re.compile(r"""['"]([A-Za-z_][\w-]*)['"]\s*[!=]=\s*[\w.]*(?:\[['"])?role\b""")
_ROLE_IN_LIST = re.compile(_ROLE + r"""\s+(?:not\s+)?in\s+[\[(]([^\])]*)[\])]""")
_QUOTED = re.compile(r"""['"]([A-Za-z_][\w-]*)['"]""")


@dataclass(frozen=True)
class InstructFormat:
    """How records become samples (module doc)."""

    format: str = "prompt_completion"
    prompt_key: str = "prompt"
    completion_key: str = "completion"
    messages_key: str = "messages"
    train_on: str = "completion"

    def __post_init__(self) -> None:
        if self.format not in FORMATS[1:]:
            raise ConfigError(
                f"instruction data format {self.format!r} is unknown", hint="use prompt_completion or chat"
            )
        if self.train_on not in TRAIN_ON:
            raise ConfigError(f"train_on={self.train_on!r} is unknown",
                              hint="use 'completion' (the completion or the assistant turns) or 'prompt' (every token)")


def template_roles(template: Any) -> frozenset[str]:
    """The roles a chat template knows: :data:`STANDARD_ROLES` and every role it names (a string
    compared with the message's role: ``message['role'] == 'ipython'``, ``m.role in ['x', 'y']``).
    ``template`` is the tokenizer's ``chat_template``: a string, or a dict of named templates."""
    text = "\n".join(map(str, template.values())) if isinstance(template, dict) else str(template or "")
    return STANDARD_ROLES | _named_roles(text)


@functools.lru_cache(maxsize=8)
def _named_roles(text: str) -> frozenset[str]:
    named = set(_ROLE_COMPARED.findall(text)) | set(_COMPARED_ROLE.findall(text))
    for group in _ROLE_IN_LIST.findall(text):
        named |= set(_QUOTED.findall(group))
    return frozenset(named)


def messages_of(record: Record, key: str, roles: frozenset[str] | None = None) -> list[dict[str, str]]:
    """The record's conversation, checked: ``{role, content}`` strings, each role one of ``roles``
    (when given: the chat template's, :func:`template_roles`) and at least one assistant turn."""
    messages = record.field(key, list, "conversation")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ConfigError(f"{record.where}: message {i} of {key!r} is not a {{'role': str, 'content': str}} object",
                              hint="each message needs a role and a text content")
        if roles is not None and m["role"] not in roles:
            raise ConfigError(
                f"{record.where}: message {i} has role {m['role']!r}, which the tokenizer's chat template does not "
                "know",
                hint=f"use one of {', '.join(sorted(roles))}, or name the role in the chat template "
                "(docs/finetuning.md, 'Chat roles')",
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(f"{record.where}: the chat has no assistant turn, so it has nothing to learn",
                          hint="give every chat at least one message with role 'assistant', or drop it from the data")
    return messages


def check_chat_tokenizer(tokenizer: Any) -> None:
    """A tokenizer that can render chats: a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "the tokenizer has no chat template, which --data.format chat renders conversations with",
            hint="save one with the tokenizer (tokenizer.chat_template = '...'; save_pretrained), or use "
            "prompt_completion",
        )


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def tokenize(record: Record, tokenizer: Any, fmt: InstructFormat) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, learned)``: the sample's token ids and which of them are targets to learn."""
    if fmt.format == "prompt_completion":
        bos = [tokenizer.bos_token_id] if getattr(tokenizer, "bos_token_id", None) is not None else []
        prompt = bos + _encode(tokenizer, record.field(fmt.prompt_key, str, "prompt"))
        completion = _encode(tokenizer, record.field(fmt.completion_key, str, "completion"))
        if tokenizer.eos_token_id is not None:
            completion.append(tokenizer.eos_token_id)
        tokens = np.asarray(prompt + completion, dtype=np.int64)
        learned = np.arange(len(tokens)) >= len(prompt)
    else:
        tokens, learned = _chat(record, tokenizer, fmt)
    if fmt.train_on == "prompt":
        learned = np.ones(len(tokens), dtype=bool)
    return tokens, learned


def _render(tokenizer: Any, messages: list[dict[str, str]], generation: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)


def _chat(record: Record, tokenizer: Any, fmt: InstructFormat) -> tuple[np.ndarray, np.ndarray]:
    messages = messages_of(record, fmt.messages_key, template_roles(tokenizer.chat_template))
    text = _render(tokenizer, messages)
    spans = []
    for j, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = (
            _render(tokenizer, messages[:j], generation=True) if j else "",
            _render(tokenizer, messages[: j + 1]),
        )
        if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
            raise ConfigError(
                f"{record.where}: the tokenizer's chat template does not render the conversation turn by turn "
                "(a prefix of the chat is not a prefix of its rendering), so the assistant turns cannot be found",
                hint="use a chat template whose rendering of the first turns begins the rendering of the whole chat",
            )
        spans.append((len(before), len(through)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    tokens = np.asarray(encoded["input_ids"], dtype=np.int64)
    offsets = encoded["offset_mapping"]
    learned = np.zeros(len(tokens), dtype=bool)
    for i, (a, b) in enumerate(offsets):
        learned[i] = any(start <= a and b <= end and b > a for start, end in spans)
    return tokens, learned


def piece(tokens: np.ndarray, learned: np.ndarray, seq_len: int) -> Piece | None:
    """The sample's ``[2, n]`` inputs and targets (module doc), cut to ``seq_len``; None when no
    target to learn is left."""
    targets = np.where(learned[1:], tokens[1:], IGNORE_INDEX)[:seq_len]
    if not (targets != IGNORE_INDEX).any():
        return None
    return np.stack([tokens[:-1][:seq_len], targets]).astype(np.int64)


@dataclass(frozen=True)
class Examples:
    """The pieces of a set of records, and how many were dropped for having no target left."""

    pieces: list[Piece]
    records: int
    dropped: int
    first_dropped: str = ""  # where the first dropped record is

    def describe(self, seq_len: int) -> str:
        kept = f"{len(self.pieces):,} sample(s)"
        if not self.dropped:
            return kept
        return (
            f"{kept}; dropped {self.dropped:,} of {self.records:,} whose prompt alone fills the {seq_len}-token "
            f"context (the first: {self.first_dropped})"
        )


def make_examples(records: Any, tokenizer: Any, fmt: InstructFormat, *, seq_len: int) -> Examples:
    """Every record tokenized and cut to ``seq_len``; the dropped ones counted. Refuses a set
    where none is left (zero targets to train on)."""
    if fmt.format == "chat":
        check_chat_tokenizer(tokenizer)
    pieces, records_seen, dropped, first = [], 0, 0, ""
    for record in records:
        records_seen += 1
        p = piece(*tokenize(record, tokenizer, fmt), seq_len)
        if p is None:
            dropped += 1
            first = first or record.where
        else:
            pieces.append(p)
    if not pieces:
        raise ConfigError(
            f"none of the {records_seen} record(s) leaves a target to learn within the {seq_len}-token context"
            + (f" (the first: {first})" if first else ""),
            hint="raise --model.seq_len, shorten the prompts, or check the completion field",
        )
    return Examples(pieces, records_seen, dropped, first)
