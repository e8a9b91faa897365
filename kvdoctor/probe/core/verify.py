"""Checking a map against the engine that is installed, before any of it is trusted.

Each hook a map names is looked up in the engine's source without importing it (the modules are
found on sys.path and parsed): the module, the class defined in it, the method in that class's
own body (what the probe patches), and every argument the hook's role reads, by name and
position. A hook that does not resolve switches its whole ledger off: a ledger fed by half its
hooks reports errors that are not there. The same argument check runs again on the live function
when it is wrapped (`check_signature`).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import os
from typing import Any

from kvdoctor.probe.core.hooks import REGISTRY
from kvdoctor.probe.maps.loader import ProbeMap, maps_by_nearness


@dataclasses.dataclass
class HookCheck:
    """One hook of a map, resolved or not (`problem` says why not)."""

    hook: str  # "Class.method" or "module.function"
    role: str
    ledger: str
    problem: str = ""


@dataclasses.dataclass
class MapCheck:
    probe_map: ProbeMap
    hooks: list[HookCheck]

    @property
    def unresolved(self) -> list[HookCheck]:
        return [h for h in self.hooks if h.problem]

    @property
    def resolved_count(self) -> int:
        return len(self.hooks) - len(self.unresolved)

    def ledgers_off(self) -> dict[str, list[str]]:
        """Ledger -> the problems that switch it off."""
        out: dict[str, list[str]] = {}
        for check in self.unresolved:
            out.setdefault(check.ledger, []).append(f"{check.hook}: {check.problem}")
        return out

    def ledgers(self) -> list[str]:
        """The ledgers the map's hooks feed; a hook that feeds none (the shutdown one) is not one."""
        return sorted({h.ledger for h in self.hooks if h.ledger})


def module_source(dotted: str) -> str | None:
    """The file that defines module `dotted`, found on sys.path without importing anything but the
    top-level package's spec."""
    top, _, rest = dotted.partition(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if not rest:
        return spec.origin if spec.origin and spec.origin.endswith(".py") else None
    directories = list(spec.submodule_search_locations or [])
    parts = rest.split(".")
    for index, part in enumerate(parts):
        last = index == len(parts) - 1
        found_dirs = []
        for directory in directories:
            package_dir = os.path.join(directory, part)
            if os.path.isdir(package_dir):
                if last and os.path.isfile(os.path.join(package_dir, "__init__.py")):
                    return os.path.join(package_dir, "__init__.py")
                found_dirs.append(package_dir)
            elif last and os.path.isfile(package_dir + ".py"):
                return package_dir + ".py"
        if not found_dirs:
            return None
        directories = found_dirs
    return None


class _SourceIndex:
    """Parsed modules, each read once per check."""

    def __init__(self) -> None:
        self._trees: dict[str, ast.Module | None] = {}

    def module(self, dotted: str) -> ast.Module | None:
        if dotted not in self._trees:
            path = module_source(dotted)
            tree = None
            if path is not None:
                try:
                    with open(path, "rb") as fh:
                        tree = ast.parse(fh.read(), filename=path)
                except (OSError, SyntaxError, ValueError):
                    tree = None
            self._trees[dotted] = tree
        return self._trees[dotted]


def _members(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Functions and simple aliases (`free_full_segment = free_segment`) defined in a body."""
    out: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
    return out


def _positional_names(node: ast.AST, *, method: bool) -> list[str] | None:
    """Parameter names a call can fill by position (self dropped); None when not a plain def."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    names = [a.arg for a in node.args.posonlyargs + node.args.args]
    return names[1:] if method and names else names


def argument_problem(names: list[str] | None, positions: dict[str, int], *, has_varargs: bool = False) -> str:
    """ "" when every (name, position) a role reads matches; otherwise what differs."""
    if names is None:
        return ""  # an alias or a non-def callable: its arguments are checked live when wrapped
    for name, position in sorted(positions.items(), key=lambda item: item[1]):
        if position < len(names) and names[position] == name:
            continue
        if name in names:
            return f"argument {name!r} is at position {names.index(name)}, not {position}"
        if position < len(names) or not has_varargs:
            return f"no argument {name!r} (positions: {', '.join(names) or 'none'})"
    return ""


def check_map(probe_map: ProbeMap) -> MapCheck:
    """Every hook of `probe_map` against the installed sources."""
    REGISTRY.load(probe_map.engine)
    index = _SourceIndex()
    checks: list[HookCheck] = []
    for spec in probe_map.classes:
        tree = index.module(spec.module)
        classes = _members(tree.body) if tree is not None else {}
        cls = classes.get(spec.cls)
        members = _members(cls.body) if isinstance(cls, ast.ClassDef) else {}
        for method, role_name in spec.methods.items():
            role = REGISTRY.get(role_name)
            check = HookCheck(f"{spec.cls}.{method}", role_name, role.ledger if role else "?")
            checks.append(check)
            if role is None:
                check.problem = f"role {role_name!r} is not one this kvdoctor knows"
            elif tree is None:
                check.problem = f"module {spec.module} not found"
            elif not isinstance(cls, ast.ClassDef):
                check.problem = f"class {spec.cls} not defined in {spec.module}"
            elif method not in members:
                check.problem = f"{spec.cls} defines no {method}"
            else:
                node = members[method]
                varargs = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.args.vararg is not None
                check.problem = argument_problem(
                    _positional_names(node, method=True), role.positions(spec.args.get(method)), has_varargs=varargs
                )
    for fn in probe_map.functions:
        role = REGISTRY.get(fn.role)
        check = HookCheck(f"{fn.module}.{fn.function}", fn.role, role.ledger if role else "?")
        checks.append(check)
        tree = index.module(fn.module)
        defined = _members(tree.body).get(fn.function) if tree is not None else None
        if role is None:
            check.problem = f"role {fn.role!r} is not one this kvdoctor knows"
        elif tree is None:
            check.problem = f"module {fn.module} not found"
        elif defined is None:
            check.problem = f"{fn.module} defines no {fn.function}"
        else:
            check.problem = argument_problem(_positional_names(defined, method=False), role.positions(None))
    return MapCheck(probe_map, checks)


def check_signature(function: Any, positions: dict[str, int], *, method: bool) -> str:
    """The live function's arguments against what the role reads ("" when they match)."""
    if not positions:
        return ""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return ""  # a builtin or C function: nothing to compare
    params = list(signature.parameters.values())
    if method and params and params[0].kind in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        params = params[1:]
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    if varargs and not names:
        return ""  # a (*args, **kwargs) wrapper of someone else's: its target is checked in the source
    return argument_problem(names, positions, has_varargs=varargs)


def nearest_resolving_map(engine: str, version: str) -> MapCheck | None:
    """For a release no map was tested on: the nearest map whose hooks all resolve in the
    installed sources; else the nearest with the most resolving (its unresolved ledgers stay off)."""
    best: MapCheck | None = None
    for candidate in maps_by_nearness(engine, version):
        check = check_map(candidate)
        if not check.unresolved:
            return check
        if best is None or _rank(check) > _rank(best):
            best = check
    return best


def _rank(check: MapCheck) -> tuple[int, int]:
    """Ledgers left fully on first (a map that keeps one ledger whole beats one that keeps none),
    then hooks resolved."""
    return (len(set(check.ledgers()) - set(check.ledgers_off())), check.resolved_count)


def describe_choice(label: str, check: MapCheck) -> str:
    """One line: which map serves this release, how many hooks resolved, which ledgers are off."""
    total = len(check.hooks)
    head = f"{label} has no tested map; using {check.probe_map.source}"
    if not check.unresolved:
        return f"{head}, all {total} hooks resolved"
    off = "; ".join(
        f"{ledger} ledger off ({', '.join(problems[:3])}{', ...' if len(problems) > 3 else ''})"
        for ledger, problems in sorted(check.ledgers_off().items())
    )
    return f"{head}, {check.resolved_count}/{total} hooks resolved; {off}"
