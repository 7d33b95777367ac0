"""Request bodies whose JSON is not Unicode text, refused where they are parsed.

Data in: a route's request, its body JSON. Data out: the body as `json.loads` reads it,
or a 400 (`BadText`, an HTTPException with the field's name) where a string in it holds
a lone surrogate.

Why: JSON may escape a UTF-16 surrogate alone (`"\\ud800"`), and Python decodes it to a
`str` that cannot be written out as UTF-8. Left in, it fails wherever the text goes next:
the tokenizer (a TypeError naming its argument's types), a chat template's prompt, or,
for a field a response echoes (a Response's `metadata`, `instructions`), the response's
own encoding, after the request ran: a 500 and a dropped connection. One check here
covers every route and field; `lamina.engine.inputs.check_unicode` does the same for
the Python API's prompts.
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable

from fastapi import HTTPException, Request
from fastapi.routing import APIRoute

_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads joins pairs; these are alone


class BadText(HTTPException):
    """400 naming the field (`param`: its top-level name, as OpenAI's errors name it)."""

    def __init__(self, detail: str, param: str | None):
        super().__init__(400, detail)
        self.param = param


def lone_surrogate(value: Any, path: tuple = ()) -> tuple[tuple, int, str] | None:
    """(the path to the first string holding a lone surrogate, its index there, the
    character), or None. Keys are checked as their values are (a key's place in the
    path is escaped: the error that names it must itself be UTF-8)."""
    if isinstance(value, str):
        m = _SURROGATE.search(value)
        return (path, m.start(), m.group()) if m else None
    if isinstance(value, dict):
        for k, v in value.items():
            if m := _SURROGATE.search(k):
                escaped = k.encode("utf-8", "backslashreplace").decode()
                return (*path, escaped), m.start(), m.group()
            if found := lone_surrogate(v, (*path, k)):
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if found := lone_surrogate(v, (*path, i)):
                return found
    return None


class _TextRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                value = json.loads(body)
                found = lone_surrogate(value)
            except json.JSONDecodeError:
                raise  # FastAPI's 400, with where in the body
            except RecursionError:
                raise BadText("body: JSON nested too deeply to read", None) from None
            except ValueError as e:  # an integer of more digits than Python converts
                raise BadText(f"body: not read: {str(e).split(';')[0]}", None) from None
            if found:
                path, at, char = found
                where = ".".join(str(p) for p in path) or "body"
                raise BadText(f"{where}: not valid Unicode: a lone surrogate "
                              f"U+{ord(char):04X} at character {at} (a JSON "
                              f"\\u{ord(char):04x} escape without its pair)",
                              str(path[0]) if path else None)
            self._json = value
        return self._json


class TextRoute(APIRoute):
    """A FastAPI route whose body JSON is checked (`app.router.route_class`)."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def checked(request: Request):
            return await handler(_TextRequest(request.scope, request.receive))

        return checked
