"""Users' own prompts for ``specdec distill --prompts-file``: chat logs as OpenAI ``messages`` JSONL or
ShareGPT JSON, validated, deduplicated and split per category before anything is trained.

Formats (told apart by the file's first character: ``[`` is ShareGPT JSON, anything else JSONL):

- JSONL, one object a line: ``{"messages": [{"role": "system"|"user"|"assistant", "content": ...}]}``
  (OpenAI chat; ``developer`` counts as ``system``; content a string or a list of ``{"type": "text"}``
  parts), ``{"prompt": "..."}`` (plain text the target continues without a chat template), or a
  ShareGPT record ``{"conversations": [...]}``. Blank lines are skipped.
- ShareGPT JSON: a list of ``{"conversations": [{"from": "human"|"gpt"|"system", "value": ...}]}``;
  ``human`` is the user and ``gpt`` the assistant (``user`` and ``assistant`` are read as well).

Any record may carry a ``category`` string; records without one fall in the category ``user``.

Which prompts a conversation gives: one per user turn, the conversation up to and including that turn
(system prompt and earlier turns as logged). The target then writes the next assistant turn itself;
the logged assistant answers are only context, never labels. So a multi-turn log teaches the draft
follow-ups as the service sees them (earlier turns in the context), not only first questions.

The split is by conversation, not by prompt, so no held-out prompt shares a logged turn with a
training prompt of the same conversation: per category, a seeded share (``held_out_share``, at least
one when the category has two conversations or more, at most ``held_out_cap``) is held out.
Identical conversations are kept once, and a training prompt equal to a held-out one is dropped.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

from draft_service.distill.prompts import Prompt

DEFAULT_CATEGORY = "user"
"""Category of a record without a ``category`` field."""

_OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
_MAX_ERRORS = 5
"""Errors listed before a bad file is refused (enough to see a pattern, not a wall of text)."""


class PromptFileError(ValueError):
    """A prompts file that cannot be read; the message names the file and each bad line or entry."""


@dataclass(frozen=True)
class Conversation:
    """One record of a prompts file: chat ``messages`` (role, content) or plain ``text``."""

    category: str
    messages: tuple[tuple[str, str], ...] | None = None
    text: str | None = None

    @property
    def key(self) -> str:
        """Identity for de-duplication."""
        return Prompt(self.category, self.text, self.messages).key

    def prompts(self) -> list[Prompt]:
        """One prompt per user turn (the conversation up to and including it), or the plain text."""
        if self.messages is None:
            return [Prompt(self.category, text=self.text)]
        return [
            Prompt(self.category, messages=self.messages[: i + 1])
            for i, (role, _) in enumerate(self.messages)
            if role == "user"
        ]


@dataclass(frozen=True)
class UserPrompts:
    """A prompts file read and split: training and held-out prompts, and how they were made."""

    path: Path
    sha256: str
    format: str
    """``jsonl`` or ``sharegpt``."""
    conversations: int
    """Distinct records read."""
    duplicate_conversations: int
    """Records dropped as identical to an earlier one."""
    duplicate_prompts: int
    """Prompts dropped as identical to another (a shared opening turn, or one held out)."""
    held_out_share: float
    held_out_cap: int
    train: tuple[Prompt, ...]
    """In a seeded order, so a token budget that stops early still covers every category."""
    held_out: tuple[Prompt, ...]

    def record(self) -> dict:
        """The prompt source as the draft card records it."""
        return {
            "kind": "file",
            "path": str(self.path),
            "sha256": self.sha256,
            "format": self.format,
            "conversations": self.conversations,
            "duplicate_conversations_dropped": self.duplicate_conversations,
            "duplicate_prompts_dropped": self.duplicate_prompts,
            "prompts_per_conversation": "one per user turn: the conversation up to and including it",
            "held_out": f"{self.held_out_share:g} of each category's conversations (at least 1 where it has 2+, "
            f"at most {self.held_out_cap}), seeded",
        }


def load_user_prompts(path: Path, held_out_share: float, held_out_cap: int, seed: int) -> UserPrompts:
    """Reads, validates, deduplicates and splits a prompts file (see the module's docstring)."""
    raw = Path(path).read_bytes()
    conversations, fmt = parse_prompts_file(raw, str(path))
    distinct: dict[str, Conversation] = {}
    for conversation in conversations:
        distinct.setdefault(conversation.key, conversation)
    unique = list(distinct.values())
    train_convs, held_convs = split_conversations(unique, held_out_share, held_out_cap, seed)
    held, seen = _distinct_prompts(held_convs, set())
    train, seen = _distinct_prompts(train_convs, seen)
    random.Random(seed + 2).shuffle(train)
    made = sum(len(c.prompts()) for c in unique)
    return UserPrompts(
        path=Path(path),
        sha256=hashlib.sha256(raw).hexdigest(),
        format=fmt,
        conversations=len(unique),
        duplicate_conversations=len(conversations) - len(unique),
        duplicate_prompts=made - len(train) - len(held),
        held_out_share=held_out_share,
        held_out_cap=held_out_cap,
        train=tuple(train),
        held_out=tuple(held),
    )


def split_conversations(
    conversations: list[Conversation], share: float, cap: int, seed: int
) -> tuple[list[Conversation], list[Conversation]]:
    """A seeded split into (train, held-out) per category: ``round(share * n)`` of a category's ``n``
    conversations held out, at least 1 when ``n >= 2`` (a category needs one to train on as well)
    and at most ``cap``; both lists keep the input order."""
    by_category: dict[str, list[int]] = {}
    for i, c in enumerate(conversations):
        by_category.setdefault(c.category, []).append(i)
    held: set[int] = set()
    for category in sorted(by_category):
        members = by_category[category]
        n = len(members)
        count = 0 if n < 2 else min(max(1, round(share * n)), cap, n - 1)
        # One stream per category, so adding a category to the file leaves the others' splits alone.
        held.update(random.Random(f"{seed}:{category}").sample(members, count))
    return (
        [c for i, c in enumerate(conversations) if i not in held],
        [c for i, c in enumerate(conversations) if i in held],
    )


def _distinct_prompts(conversations: list[Conversation], seen: set[str]) -> tuple[list[Prompt], set[str]]:
    """The conversations' prompts, skipping any whose key is in ``seen`` (which grows)."""
    out = []
    for c in conversations:
        for p in c.prompts():
            if p.key not in seen:
                seen.add(p.key)
                out.append(p)
    return out, seen


def parse_prompts_file(raw: bytes, name: str) -> tuple[list[Conversation], str]:
    """The records of a prompts file's bytes and its format (``jsonl`` or ``sharegpt``); raises
    ``PromptFileError`` naming ``name`` and every bad line (JSONL) or entry (ShareGPT), up to five."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise PromptFileError(f"{name}: not UTF-8 text ({e})") from None
    sharegpt = text.lstrip().startswith("[")
    conversations, errors = _parse_sharegpt(text, name) if sharegpt else _parse_jsonl(text)
    if errors:
        more = f" (and {len(errors) - _MAX_ERRORS} more)" if len(errors) > _MAX_ERRORS else ""
        raise PromptFileError(f"{name}: " + "; ".join(errors[:_MAX_ERRORS]) + more)
    if not conversations:
        raise PromptFileError(f"{name}: no prompts in it")
    return conversations, "sharegpt" if sharegpt else "jsonl"


def _parse_jsonl(text: str) -> tuple[list[Conversation], list[str]]:
    """Records of JSONL text, and an error for each bad line (naming its 1-based number)."""
    out, errors = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append(_record(json.loads(line)))
        except json.JSONDecodeError as e:
            errors.append(f"line {number}: not JSON ({e.msg} at column {e.colno})")
        except ValueError as e:
            errors.append(f"line {number}: {e}")
    return out, errors


def _parse_sharegpt(text: str, name: str) -> tuple[list[Conversation], list[str]]:
    """Records of a ShareGPT JSON list, and an error for each bad entry (naming its 1-based index)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PromptFileError(f"{name}: not JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    if not isinstance(data, list):
        raise PromptFileError(f"{name}: a ShareGPT file is a JSON list of {{'conversations': [...]}} entries")
    out, errors = [], []
    for number, entry in enumerate(data, start=1):
        try:
            if not isinstance(entry, dict) or "conversations" not in entry:
                raise ValueError("expected an object with a 'conversations' list")
            out.append(_record(entry))
        except ValueError as e:
            errors.append(f"entry {number}: {e}")
    return out, errors


def _record(obj) -> Conversation:
    """One record (a JSONL line's object or a ShareGPT entry); raises ``ValueError`` saying what is wrong."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    category = obj.get("category", DEFAULT_CATEGORY)
    if not isinstance(category, str) or not category.strip():
        raise ValueError("'category' must be a non-empty string")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
            raise ValueError("'prompt' must be a non-empty string")
        return Conversation(category, text=obj["prompt"])
    if "messages" in obj:
        turns = _turns(obj["messages"], "messages", "role", "content", _OPENAI_ROLES)
    elif "conversations" in obj:
        turns = _turns(obj["conversations"], "conversations", "from", "value", _SHAREGPT_ROLES)
    else:
        raise ValueError("expected a 'messages' list, a 'conversations' list or a 'prompt' string")
    if not any(role == "user" for role, _ in turns):
        raise ValueError("no user turn (nothing for the target to answer)")
    return Conversation(category, messages=turns)


def _turns(items, field: str, role_key: str, content_key: str, roles: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """(role, content) pairs of a message list, roles mapped through ``roles``; raises ``ValueError``."""
    if not isinstance(items, list) or not items:
        raise ValueError(f"'{field}' must be a non-empty list")
    out = []
    for i, item in enumerate(items, start=1):
        if not isinstance(item, dict):
            raise ValueError(f"{field}[{i}] is not an object")
        role = item.get(role_key)
        if role not in roles:
            known = ", ".join(repr(r) for r in roles)
            raise ValueError(f"{field}[{i}]: {role_key} {role!r} is not one of {known}")
        content = _text(item.get(content_key))
        if content is None:
            raise ValueError(f"{field}[{i}]: '{content_key}' must be text (a string or a list of text parts)")
        if not content.strip():
            raise ValueError(f"{field}[{i}]: empty '{content_key}'")
        out.append((roles[role], content))
    return tuple(out)


def _text(content) -> str | None:
    """A message's text: a string, or OpenAI content parts that are all text; None otherwise."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        if all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            return "\n".join(p["text"] for p in content)
    return None
