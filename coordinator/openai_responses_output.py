"""OpenAI's Responses API (``POST /v1/responses``): the answer, as output items and streaming events.

``ResponseBuilder`` turns the round loop's text into Responses output items (``message`` items with
one ``output_text`` part, ``function_call`` items) in the order the model wrote them, and the
streaming events around them; a whole response is the final state of the same events, so streamed
and whole answers agree. The request it answers is ``coordinator.openai_responses``' translation.

Everything here is JSON in, JSON out, except that a builder names its response and items with fresh
random ids and stamps the response with the time it was made (both can be given, for tests);
``coordinator.openai_api`` serves it.
"""

from __future__ import annotations

import copy
import json
import secrets
import time
from typing import Any

from coordinator.openai_responses import ResponsesRequest
from coordinator.openai_schema import FINISH_REASON, ApiError, speculation
from coordinator.tools import Segment, ToolCall, ToolCallSplitter
from coordinator.turns import Stats


def usage(stats: Stats) -> dict[str, Any]:
    """The Responses API's ``usage``: the whole rendered conversation's tokens and the output's."""
    return {
        "input_tokens": stats.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": stats.generated_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
    }


def sse_event(event: dict[str, Any]) -> bytes:
    """One server-sent event, named by its type as OpenAI's Responses streams name them."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


class ResponseBuilder:
    """One response, built as its output arrives: the streaming events, and the response object.

    ``feed`` takes the round loop's text as it comes and returns the events it makes: content text
    streams into a ``message`` item's ``output_text`` part; with tools, each call (split out by
    ``coordinator.tools.ToolCallSplitter``) closes the open message and becomes a ``function_call``
    item of its own, sent whole (one arguments delta), and text after it opens a new message. So the
    items follow the written order, however the text was cut into chunks. On the last chunk the open
    item closes and the response ends ``completed``, or ``incomplete`` (reason ``max_output_tokens``)
    when the output was cut by the limit or the context. A whole (non-streaming) answer is
    ``response()`` after the last chunk: the state the events built.
    """

    def __init__(
        self, request: ResponsesRequest, response_id: str | None = None, created_at: int | None = None
    ) -> None:
        self._request = request
        self.id = response_id or "resp_" + secrets.token_hex(24)
        self.created_at = int(time.time()) if created_at is None else created_at
        tools = request.chat.tools
        self._split: ToolCallSplitter | None = (
            tools.splitter() if tools is not None and request.chat.parses_tools else None
        )
        self._items: list[dict[str, Any]] = []
        self._open: int | None = None  # the index of the message item text goes to
        self._sequence = 0
        self._status = "in_progress"
        self._stats: Stats | None = None
        self._error: dict[str, str] | None = None
        # The answer as the chat path remembers it: content and calls.
        self.content = ""
        self.calls: list[ToolCall] = []

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        """A stream's opening events: ``response.created`` and ``response.in_progress``."""
        return [
            self._event("response.created", response=self.response()),
            self._event("response.in_progress", response=self.response()),
        ]

    def feed(self, text: str, finish: str | None = None, stats: Stats | None = None) -> list[dict[str, Any]]:
        """The events for ``text``, the next piece of output; on the last (``finish``, with ``stats``)
        also the events that close the response."""
        events: list[dict[str, Any]] = []
        if self._split is None:
            segments: list[Segment] = [text] if text else []
        else:
            segments = self._split.feed(text, end=finish is not None)
        for segment in segments:  # in written order: text after a call opens a message of its own
            if isinstance(segment, str):
                events += self._text(segment)
            else:
                events += self._close_message("completed")
                events += self._call(segment)
        if finish is None:
            return events
        if not self._items:  # nothing was written: an empty message, as an answer of no text
            events += self._text("")
        cut = FINISH_REASON[finish] == "length"
        events += self._close_message("incomplete" if cut else "completed")
        self._status, self._stats = ("incomplete" if cut else "completed"), stats
        events.append(self._event(f"response.{self._status}", response=self.response()))
        return events

    def fail(self, error: ApiError) -> list[dict[str, Any]]:
        """The events that end a stream that failed after it began: ``error``, then ``response.failed``."""
        self._status = "failed"
        code = error.code or "server_error"
        self._error = {"code": code, "message": error.message}
        return [
            self._event("error", code=code, message=error.message, param=error.param),
            self._event("response.failed", response=self.response()),
        ]

    def _text(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None:
            self._open = len(self._items)
            item_id = "msg_" + secrets.token_hex(24)
            self._items.append(
                {"id": item_id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}
            )
            events.append(
                self._event("response.output_item.added", output_index=self._open, item=self._item(self._open))
            )
            self._items[self._open]["content"].append(
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            )
            events.append(self._event("response.content_part.added", **self._where(), part=_part("")))
        self.content += text
        self._items[self._open]["content"][0]["text"] += text
        if text:
            events.append(self._event("response.output_text.delta", **self._where(), delta=text, logprobs=[]))
        return events

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._items[self._open]["id"], "output_index": self._open, "content_index": 0}

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        index, where = self._open, self._where()
        text = self._items[index]["content"][0]["text"]
        self._items[index]["status"] = status
        self._open = None
        return [
            self._event("response.output_text.done", **where, text=text, logprobs=[]),
            self._event("response.content_part.done", **where, part=_part(text)),
            self._event("response.output_item.done", output_index=index, item=self._item(index)),
        ]

    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        self.calls.append(call)
        index, item_id = len(self._items), "fc_" + secrets.token_hex(24)
        item = {
            "id": item_id,
            "type": "function_call",
            "status": "in_progress",
            "arguments": "",
            "call_id": call.id,
            "name": call.name,
        }
        self._items.append(item)
        added = self._event("response.output_item.added", output_index=index, item=self._item(index))
        item.update(arguments=call.arguments, status="completed")
        where = {"item_id": item_id, "output_index": index}
        return [
            added,
            self._event("response.function_call_arguments.delta", **where, delta=call.arguments),
            self._event("response.function_call_arguments.done", **where, name=call.name, arguments=call.arguments),
            self._event("response.output_item.done", output_index=index, item=self._item(index)),
        ]

    def _item(self, index: int) -> dict[str, Any]:
        return copy.deepcopy(self._items[index])

    def response(self) -> dict[str, Any]:
        """The response object as it stands: ``in_progress`` until the last chunk, then
        ``completed``, ``incomplete`` or ``failed``, with ``usage`` and the ``specdec`` field once done."""
        done = self._stats is not None
        body: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self._status,
            "background": False,
            "error": self._error,
            "incomplete_details": {"reason": "max_output_tokens"} if self._status == "incomplete" else None,
            "model": self._request.chat.model,
            "output": [copy.deepcopy(item) for item in self._items],
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "service_tier": "default",
            "store": False,
            "truncation": "disabled",
            **copy.deepcopy(self._request.settings),
            "usage": usage(self._stats) if self._stats is not None else None,
        }
        if done:
            assert self._stats is not None
            body["specdec"] = speculation(self._stats)
        return body


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
