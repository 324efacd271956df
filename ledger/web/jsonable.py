"""The values of the JSON endpoints: a page's facts as JSON types.

Instants as ISO 8601 strings with their offset, durations as seconds
(floats), dataclasses as objects.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import date, datetime, timedelta
from typing import Any


def jsonable(value: Any) -> Any:
    """``value`` with every datetime, timedelta and dataclass turned into JSON types."""
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: jsonable(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(item) for item in value]
    return value
