"""How pgq shows its values as JSON, one rule for every front (CLI ``--json``,
HTTP API, dashboard).

* A job body is text when it is valid UTF-8 (``"body": "..."``), otherwise
  base64 under ``"body_base64"`` (never Python's ``b'...'`` spelling, which
  no other language can read). Other bytes values follow the same rule, as
  ``{"base64": "..."}`` when they are not text.
* Times are ISO-8601 strings with their offset (``2026-11-25T10:21:49.5+00:00``);
  durations are seconds (a number); NUMERIC values are numbers.
* Everything else JSON knows is left as it is; anything it does not is its
  ``str()``.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import json
from typing import Any

__all__ = ["jsonable", "dumps", "body_fields"]


def body_fields(body: bytes | bytearray | memoryview, key: str = "body") -> dict[str, str]:
    """``{key: text}`` for a UTF-8 body, ``{key + "_base64": ...}`` otherwise."""
    raw = bytes(body)
    try:
        return {key: raw.decode("utf-8")}
    except UnicodeDecodeError:
        return {f"{key}_base64": base64.b64encode(raw).decode()}


def jsonable(value: Any) -> Any:
    """``value`` with every part JSON can carry as the rules above say."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if key == "body" and isinstance(item, (bytes, bytearray, memoryview)):
                out.update(body_fields(item))
            else:
                out[str(key)] = jsonable(item)
        return out
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        fields = body_fields(value, "text")
        return fields["text"] if "text" in fields else {"base64": fields["text_base64"]}
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def dumps(value: Any) -> str:
    """One JSON document (keys sorted, so output is stable for scripts and diffs)."""
    return json.dumps(jsonable(value), sort_keys=True)
