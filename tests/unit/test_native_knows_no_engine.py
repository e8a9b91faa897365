"""The compiled core of the probe knows no engine: no C source or header names an engine, a module of
one, or a name an engine map or an engine package's roles use. The names the C reads and calls come
from Python when the extension is set up, so a release that renames an attribute is a change to a
map or a role, never to the C.

The names are collected, not listed: every module, class, function, method, argument and option
value of the engine maps (probes/*.toml), and every attribute an engine package reads (attribute
access, getattr/hasattr/setattr names, `reads` keys). Names Python, torch or numpy give their own
objects, and names kvdoctor's own code outside the engine packages defines (its ledger's methods,
the extension's own keywords), are the C's to use.
"""

from __future__ import annotations

import ast
import builtins
import keyword
import pathlib
import re
import types

import pytest
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROBE = ROOT / "kvdoctor" / "probe"
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def engine_maps() -> list[dict]:
    return [tomllib.loads(p.read_text()) for p in sorted((ROOT / "probes").glob("*.toml")) if "engine" in tomllib.loads(p.read_text())]


def engines() -> list[str]:
    return [str(m["engine"]) for m in engine_maps()]


def engine_packages() -> list[pathlib.Path]:
    """Each engine's package under kvdoctor/probe, wherever the probe's layout puts it."""
    found = [d for name in engines() for d in PROBE.rglob(name) if d.is_dir() and (d / "__init__.py").exists()]
    assert found, "no engine package found under kvdoctor/probe"
    return found


def _identifiers(text: str) -> set[str]:
    return set(IDENT.findall(text))


def map_names() -> set[str]:
    """Modules, classes, functions, methods, arguments and option values of every engine map."""
    names: set[str] = set()

    def values(v: object) -> list[str]:
        """A plain value, or the values of a list of `{ value = ..., since/until }` entries."""
        if isinstance(v, str):
            return [v]
        if isinstance(v, list):
            return [x for e in v for x in (values(e.get("value")) if isinstance(e, dict) else values(e))]
        return []

    for m in engine_maps():
        for entry in m.get("classes", []) + m.get("functions", []):
            for key, value in entry.items():
                if key in ("methods", "args"):
                    for method in value:
                        names |= _identifiers(method)
                elif key == "module":  # the dotted path, and its parts that are not plain words
                    names |= {value} | {part for part in value.split(".") if compound(part)}
                elif key not in ("since", "until", "kind", "role"):
                    for text in values(value):
                        names |= _identifiers(text)
        for key, value in m.get("allocator_defaults", {}).items():
            if key != "group_open_when":  # the map's own words for a test, not an attribute
                names |= {x for text in values(value) for x in _identifiers(text)}
    return names


def role_names() -> set[str]:
    """What the engine packages read of the engine's objects and call on them."""
    names: set[str] = set()
    for package in engine_packages():
        for path in package.rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and compound(node.attr):
                    names.add(node.attr)  # a plain word read on the engine's objects is found as a getattr name
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args[1:]:
                    if node.func.id in ("getattr", "hasattr", "setattr", "delattr", "own"):
                        name = node.args[1]
                        if isinstance(name, ast.Constant) and isinstance(name.value, str):
                            names |= _identifiers(name.value)
                elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "reads" for t in node.targets):
                    if isinstance(node.value, ast.Dict):
                        names |= {k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return names


def own_names() -> set[str]:
    """Names that are not an engine's: Python's, torch's and numpy's for their objects, and the
    functions, classes, fields and method arguments the probe defines outside the engine packages
    (its ledgers' own)."""
    import numpy
    import torch

    names = set(dir(builtins)) | set(keyword.kwlist)
    for obj in (object, dict, list, tuple, str, int, float, set, bytes, torch.Tensor, numpy.ndarray, torch):
        names |= set(dir(obj))
    for kind in (types.FrameType, types.CodeType):
        names |= set(dir(kind))
    skip = engine_packages()
    for path in PROBE.rglob("*.py"):
        if any(package in path.parents for package in skip):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.ClassDef):
                names.add(node.name)
                for item in node.body:  # its fields, and its methods' arguments
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        names.add(item.target.id)
                    elif isinstance(item, ast.Assign):
                        names |= {t.id for t in item.targets if isinstance(t, ast.Name)}
                    elif isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names |= {a.arg for a in ast.walk(item.args) if isinstance(a, ast.arg)}
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id == "self":
                    names.add(node.attr)
    return names


def engine_names() -> set[str]:
    return (map_names() | role_names()) - own_names()


def sources() -> list[pathlib.Path]:
    found = sorted(p for p in (ROOT / "kvdoctor").rglob("*") if p.suffix in (".c", ".h"))
    assert found, "no C sources found under kvdoctor/"
    return found


def split(text: str) -> tuple[str, str, str]:
    """A C file's code, string literals and comments, apart."""
    code, strings, comments = [], [], []
    pattern = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'', re.S)
    last = 0
    for m in pattern.finditer(text):
        code.append(text[last : m.start()])
        (strings if m.group().startswith(('"', "'")) else comments).append(m.group())
        last = m.end()
    code.append(text[last:])
    return " ".join(code), " ".join(strings), " ".join(comments)


def compound(name: str) -> bool:
    """A name no English sentence or C local uses by chance: with an underscore or a capital."""
    return "_" in name.strip("_") or name != name.lower()


def offences(text: str, names: set[str]) -> list[str]:
    code, strings, comments = split(text)
    literals = {s[1:-1] for s in re.findall(r'"(?:\\.|[^"\\])*"', strings)}  # a plain word counts only as a whole literal
    found = [w for w in engines() if re.search(w, text, re.I)]
    for name in sorted(names):
        word = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])")
        if name in literals if not compound(name) else word.search(strings):
            found.append(f"{name} (a string)")
        elif compound(name) and (word.search(code) or word.search(comments)):
            found.append(name)
    return found


def test_the_collected_names_hold_what_the_c_once_named():
    """The collection is not empty and holds names the fast paths read (else the scan below could
    pass on nothing)."""
    names = engine_names()
    assert {"token_to_kv_pool_allocator", "lock_ref", "root_node", "req_to_token", "RadixCache"} <= names
    assert "numel" not in names and "on_alloc" not in names
    assert offences('x = "lock_ref"; /* RadixCache.insert */ int sglang_x;', names) == ["sglang", "RadixCache", "lock_ref (a string)"]


@pytest.mark.parametrize("path", sources(), ids=lambda p: p.name)
def test_no_c_source_names_an_engine(path: pathlib.Path):
    assert offences(path.read_text(), engine_names()) == []
