"""Building a turn's token sequence from plain text or chat messages, on top of a session's history."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.tools import template_handles_tools, template_inputs


@dataclass(frozen=True)
class Turn:
    """The full token sequence the model sees this turn, and the chat history it came from."""

    tokens: list[int]
    messages: list[dict[str, str]] | None


class NoChatTemplate(ValueError):
    """Chat messages were sent to a model whose tokenizer has no chat template."""


def render_chat(tokenizer, messages: list[dict[str, str]], tools: str = "") -> list[int]:
    """Chat messages rendered with the tokenizer's template and the generation prompt.

    ``tools`` (JSON text of OpenAI tool definitions, "" for none) and the messages' tool calls and
    results are rendered by the template when it knows tools, else by ``coordinator.tools``' fallback.

    Raises ``NoChatTemplate`` when the tokenizer has none: guessing a format would make the model
    answer something other than what it was trained to.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplate(
            "messages: this model has no chat template; send plain text, or start the coordinator with "
            "--chat-template (a name such as chatml or gemma, or a Jinja file)"
        )
    conversation, definitions = template_inputs(messages, tools, template_handles_tools(tokenizer))
    extra = {} if definitions is None else {"tools": definitions}
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, **extra)
    if hasattr(ids, "keys"):  # transformers 5 may hand back a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def build_turn(
    tokenizer,
    history_tokens: list[int],
    history_messages: list[dict[str, str]] | None,
    text: str | None,
    messages: list[dict[str, str]] | None,
    tools: str = "",
    whole: bool = False,
) -> Turn:
    """This turn's tokens: plain text is appended to the history as is; chat re-renders the whole
    conversation, so the template decides the separators.

    Plain text that opens a session is encoded with the special tokens the tokenizer adds to a text
    (Gemma's ``<bos>``; none for SmolLM2), as transformers encodes a prompt; a continuation adds none.

    A session that spoke chat keeps its messages; its next chat turn renders history + new messages,
    and the caches keep whatever prefix the rendering shares with the committed tokens. ``tools`` are
    this request's (``render_chat``): the whole conversation is rendered with them. ``whole``: the
    messages are the whole conversation, history included, and are rendered as they are (the
    session's own record of its history is not used).
    """
    if messages is None:
        opening = not history_tokens
        return Turn(history_tokens + tokenizer.encode(text, add_special_tokens=opening), history_messages)
    if whole:
        return Turn(render_chat(tokenizer, messages, tools), messages)
    if history_messages is None and history_tokens:
        return Turn(history_tokens + render_chat(tokenizer, messages, tools), None)
    conversation = [*(history_messages or []), *messages]
    return Turn(render_chat(tokenizer, conversation, tools), conversation)
