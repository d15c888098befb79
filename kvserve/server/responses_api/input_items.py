"""`GET /v1/responses/{id}/input_items`: the items a stored response was generated from, one page at a time.

A response's input items are everything it saw, as OpenAI lists them for a continuation: the
earlier turns of its `previous_response_id` chain (their input and output items) and then its own
input; never its own output nor its `instructions`. Invariants:

- Every stored item has an `id` (`with_id` gives one to an input item that came without it, and an
  output item keeps the id it was answered with), so an id names the same item on every page and
  in every response of a chain. A row stored without ids gets ones made of the response's id and
  the item's place, stable across calls too.
- Items are listed in OpenAI's item shapes, each `status: "completed"`; `after` and `before` are
  ids of the list in the order asked, and a cursor that names no item of it is a 400.
"""

from __future__ import annotations

from typing import Literal

from kvserve.server.errors import invalid
from kvserve.server.responses_api.bodies import ITEM_ID_PREFIXES, new_item_id
from kvserve.server.responses_api.schemas import (
    FunctionCallItem, FunctionCallOutputItem, InputItem, MessageItem, ReasoningItem,
)
from kvserve.server.responses_api.store import StoredResponse

Order = Literal["asc", "desc"]


def with_id(item: InputItem) -> InputItem:
    """`item`, with a new id of its type's prefix unless the client gave it one."""
    return item if item.id else item.model_copy(update={"id": new_item_id(item.type)})


def input_items(stored: StoredResponse) -> list[dict]:
    """The items `stored` was generated from, oldest first, in OpenAI's item shapes."""
    seen = stored.context[:len(stored.context) - len(stored.body["output"])]
    fallback = stored.body["id"].removeprefix("resp_")
    return [_listed(item, item.id or f"{ITEM_ID_PREFIXES[item.type]}_{fallback}_{index}") for index, item in enumerate(seen)]


def page(items: list[dict], order: Order, limit: int, after: str | None, before: str | None) -> dict:
    """OpenAI's list object for `items` (oldest first) in `order`: at most `limit` of those after
    `after` and before `before`; with `before` alone, the `limit` just before it."""
    ordered = items if order == "asc" else items[::-1]
    start = _place(ordered, after, "after") + 1 if after is not None else 0
    end = _place(ordered, before, "before") if before is not None else len(ordered)
    window = ordered[start:end]
    data = window[-limit:] if before is not None and after is None else window[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(window) > limit}


def _place(items: list[dict], item_id: str, param: str) -> int:
    index = next((i for i, item in enumerate(items) if item["id"] == item_id), None)
    if index is None:
        raise invalid(f"{param}: no input item with id '{item_id}' in this response", param)
    return index


def _listed(item: InputItem, item_id: str) -> dict:
    if isinstance(item, MessageItem):
        return {"id": item_id, "type": "message", "role": item.role, "status": "completed",
                "content": _parts(item)}
    if isinstance(item, FunctionCallItem):
        return {"id": item_id, "type": "function_call", "call_id": item.call_id, "name": item.name,
                "arguments": item.arguments, "status": "completed"}
    if isinstance(item, FunctionCallOutputItem):
        output = item.output if isinstance(item.output, str) else [part.model_dump() for part in item.output]
        return {"id": item_id, "type": "function_call_output", "call_id": item.call_id, "output": output,
                "status": "completed"}
    assert isinstance(item, ReasoningItem)
    return {**item.model_dump(), "id": item_id, "status": "completed"}


def _parts(item: MessageItem) -> list[dict]:
    """A message's content as parts: an assistant's text is `output_text` (with its `annotations`,
    as OpenAI's output message has), anyone else's `input_text`."""
    parts = [{"type": "output_text" if item.role == "assistant" else "input_text", "text": item.content}] \
        if isinstance(item.content, str) else [part.model_dump() for part in item.content]
    return [{**part, "annotations": []} if part["type"] == "output_text" else part for part in parts]
