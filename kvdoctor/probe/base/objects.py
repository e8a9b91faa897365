"""Reading an engine's objects from inside it without running any of its code.

The probe looks at what the engine built (its allocators, trees, managers) to prove what it sees;
a property or a custom attribute lookup could run host code, take a lock or raise, so only plain
instance attributes are read.

Nor does it ask for an object's `__dict__` unless it must. From CPython 3.11 an instance keeps its
attributes in an array beside it, and `obj.__dict__` makes CPython build a dict for it once and for
all: the engine's own attribute reads on that object then miss their inline caches for the rest of
the process (measured: 1.3-2 % of the allocator loop when its allocator, request pool and tree had
one built). So attributes are read by name, and an object's attributes are listed from the names
its class's code stores, checked against what the collector sees the object hold.
"""

from __future__ import annotations

import dis
import gc
import types
from typing import Any

_MISSING = object()
_HOOK_MODULE = "kvdoctor.probe.native._native"  # the compiled hook's type, which keeps the original as __wrapped__
_NAMES_CACHE_MAX = 512  # classes whose attribute names were learned (a server has a few dozen)
_names_of_class: dict[type, tuple[tuple[str, Any], ...]] = {}


def _plain(obj: Any) -> bool:
    """No custom attribute lookup runs when its attributes are read (and it is not a class)."""
    lookup: Any = type(obj).__getattribute__
    return lookup is object.__getattribute__ and not isinstance(obj, type)


def has_attributes(obj: Any) -> bool:
    """A plain object whose class gives its instances attributes of their own (a `__dict__`)."""
    return _plain(obj) and type(obj).__dictoffset__ != 0


def instance_dict(obj: Any) -> dict[str, Any] | None:
    """`obj.__dict__` for a plain object (no custom attribute lookup, property or class attribute
    runs), else None. CPython builds it if the object had none yet: where a name is known, `own`."""
    if not _plain(obj):
        return None
    try:
        attrs = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        return None
    return attrs if type(attrs) is dict else None


def _class_attribute(cls: type, name: str) -> Any:
    for klass in cls.__mro__:
        found = klass.__dict__.get(name, _MISSING)
        if found is not _MISSING:
            return found
    return _MISSING


def _held(obj: Any) -> list[Any]:
    """What the collector sees a plain object hold, its class aside: its attribute values, or the
    one `__dict__` CPython built for it."""
    cls = type(obj)
    return [r for r in gc.get_referents(obj) if r is not cls]


def _built_dict(obj: Any, held: list[Any]) -> dict[str, Any] | None:
    """Its `__dict__` where CPython already built one (or its one attribute is a dict), else None."""
    return instance_dict(obj) if len(held) == 1 and type(held[0]) is dict else None


def _read(obj: Any, name: str, declared: Any) -> Any:
    """The instance attribute `name` of a plain object, or _MISSING (`declared`: what its class
    holds under that name, _MISSING for nothing). Where that is a descriptor that is not a data
    descriptor (a method, a cached_property), the value is only in the instance dict: read where
    CPython built one already, else taken as missing."""
    if declared is not _MISSING:
        kind = type(declared)
        if hasattr(kind, "__set__") or hasattr(kind, "__delete__"):
            return _MISSING  # a property or a slot: what the instance dict may hold is never read
        if hasattr(kind, "__get__"):
            attrs = _built_dict(obj, _held(obj))
            return attrs.get(name, _MISSING) if attrs is not None else _MISSING
    try:
        value = object.__getattribute__(obj, name)  # the instance's own value; no __getattr__ runs
    except AttributeError:
        return _MISSING
    return _MISSING if declared is not _MISSING and value is declared else value


def own(obj: Any, name: str) -> Any:
    """An instance attribute, never a property or a class attribute (no host code runs)."""
    if not _plain(obj):
        return None
    value = _read(obj, name, _class_attribute(type(obj), name))
    return None if value is _MISSING else value


def _codes(member: Any) -> list[types.CodeType]:
    """The code of a class member that is a function: a method, a classmethod or staticmethod, a
    property's accessors, and what a hook or a functools.wraps wrapper wraps. Only CPython's own
    function types and the probe's compiled hook are looked into: reading an attribute of anything
    else could run the host's code."""
    parts: list[Any]
    if isinstance(member, property):
        parts = [member.fget, member.fset, member.fdel]
    elif isinstance(member, (classmethod, staticmethod)):
        parts = [member.__func__]
    else:
        parts = [member]
    codes: list[types.CodeType] = []
    for function in parts:
        for _ in range(8):  # wrappers of wrappers, bounded
            if type(function) is types.FunctionType:
                codes.append(function.__code__)
                function = function.__dict__.get("__wrapped__")
            elif type(function).__qualname__ == "Hooked" and type(function).__module__ == _HOOK_MODULE:
                function = function.__wrapped__
            else:
                break
    return codes


def _stored_names(cls: type) -> tuple[tuple[str, Any], ...]:
    """The attribute names the code of `cls` and its bases stores (`x.name = ...` in any of their
    functions, nested ones included), each with what the class holds under it (_MISSING: nothing),
    slots left out: where an object's attributes are looked for, by name."""
    names = _names_of_class.get(cls)
    if names is not None:
        return names
    found: dict[str, None] = {}
    for klass in cls.__mro__:
        for member in list(vars(klass).values()):
            stack = _codes(member)
            while stack:
                code = stack.pop()
                found.update(dict.fromkeys(i.argval for i in dis.get_instructions(code) if i.opname == "STORE_ATTR"))
                stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    declared = ((name, _class_attribute(cls, name)) for name in found)
    names = tuple((name, d) for name, d in declared if not isinstance(d, types.MemberDescriptorType))
    if len(_names_of_class) >= _NAMES_CACHE_MAX:
        _names_of_class.clear()
    _names_of_class[cls] = names
    return names


def instance_items(obj: Any) -> list[tuple[str, Any]]:
    """An object's instance attributes with their names (no property runs), without building its
    `__dict__` where its class's code stores every attribute it holds: the names are read one by
    one, and kept only if the collector finds each value among what the object holds, as many as
    it holds (in the order it holds them, which is the dict's). Otherwise (an attribute set from
    outside its class, or by `setattr`) its `__dict__`, as before."""
    if not _plain(obj):
        return []
    cls = type(obj)
    held = _held(obj)
    built = _built_dict(obj, held)
    if built is not None:
        return list(built.items())
    if not held:
        return []
    found = []
    for name, declared in _stored_names(cls):
        value = _read(obj, name, declared)
        if value is not _MISSING:
            found.append((name, value))
            if len(found) == len(held):  # each value is one reference the object holds: no more to find
                break
    first_place = {id(h): i for i, h in reversed(list(enumerate(held)))}
    places = [first_place.get(id(v), -1) for _, v in found]
    if len(found) == len(held) and -1 not in places:
        return [item for _, item in sorted(zip(places, found, strict=True), key=lambda pair: pair[0])]  # in the order CPython keeps
    attrs = instance_dict(obj)
    return list(attrs.items()) if attrs is not None else []


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
