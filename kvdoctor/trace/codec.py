"""The trace's JSON codec: orjson where installed (several times faster), the stdlib otherwise.

Shared by the writer (inside the server, so standard library only besides orjson) and the reader.
"""

from __future__ import annotations

import json
from typing import Any

try:  # orjson is several times faster; the stdlib is the fallback everywhere.
    import orjson as _orjson

    def dumps(obj: Any) -> bytes:
        try:
            return _orjson.dumps(obj, option=_orjson.OPT_SERIALIZE_NUMPY, default=_default)
        except TypeError:  # integers beyond 64 bits and other values orjson refuses
            return json.dumps(_finite(obj), separators=(",", ":"), default=_default).encode()

    def loads(data: bytes) -> Any:
        try:
            return _orjson.loads(data)
        except _orjson.JSONDecodeError:
            return json.loads(data)  # integers beyond 64 bits, which orjson does not read

except ImportError:  # pragma: no cover - depends on the environment

    def dumps(obj: Any) -> bytes:
        return json.dumps(_finite(obj), separators=(",", ":"), default=_default).encode()

    def loads(data: bytes) -> Any:
        return json.loads(data)


def _finite(obj: Any) -> Any:
    """NaN and infinities become null, as orjson writes them: the trace stays strict JSON."""
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _default(obj: Any) -> Any:
    """Numbers from numpy/torch and sets reach the trace as plain JSON values."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    return str(obj)
