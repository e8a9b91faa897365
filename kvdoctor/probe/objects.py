"""Reading an engine's objects from inside it without running any of its code.

The probe looks at what the engine built (its allocators, trees, managers) to prove what it sees;
a property or a custom attribute lookup could run host code, take a lock or raise, so only plain
instance attributes are read.
"""

from __future__ import annotations

import types
from typing import Any


def instance_dict(obj: Any) -> dict[str, Any] | None:
    """`obj.__dict__` for a plain object (no custom attribute lookup, property or class attribute
    runs), else None."""
    lookup: Any = type(obj).__getattribute__
    if lookup is not object.__getattribute__ or isinstance(obj, type):
        return None
    try:
        attrs = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        return None
    return attrs if type(attrs) is dict else None


def own(obj: Any, name: str) -> Any:
    """An instance attribute, never a property or a class attribute (no host code runs)."""
    attrs = instance_dict(obj)
    return attrs.get(name) if attrs is not None else None


def own_slot(obj: Any, name: str) -> Any:
    """A `__slots__` attribute (an object with no `__dict__`, which `own` cannot read), read through
    its member descriptor, which is C code: no host code runs. None where `name` is not a slot, or
    is one never set."""
    for cls in type(obj).__mro__:
        found = cls.__dict__.get(name)
        if found is None:
            continue
        if not isinstance(found, types.MemberDescriptorType):
            return None
        try:
            return found.__get__(obj, type(obj))
        except AttributeError:  # the slot was never set
            return None
    return None
