"""The KV and request pool classes an installed SGLang defines, and what the probe makes of each,
read from the sources (nothing is imported), for `kvdoctor probes`.

The standing of a class follows the rules the running probe applies (`probe/engines/sglang/coverage.py`):
- judged: a class the map hooks by name (an allocator or a request pool), or a request pool that
  derives from one without writing or giving back rows in its own methods;
- hooked, not judged: a class that inherits some hooked methods but is not one the map describes
  (a Mamba or unified composite over token allocators, a request pool with its own row writer, a
  class deriving from the SWA pool with free paths of its own): its ledger counts and says why it
  does not judge, and so does this listing;
- not covered: nothing of it is hooked.
"""

from __future__ import annotations

import ast
import dataclasses
import os

from kvdoctor.probe.core.verify import module_source
from kvdoctor.probe.maps.loader import ProbeMap

SCANNED_PACKAGES = ("sglang.srt.mem_cache", "sglang.srt.disaggregation")
POOL_SUFFIXES = ("Allocator", "ReqToTokenPool")
# the SWA pool's methods whose own version in a subclass takes a path the SWA ledger does not follow
SWA_PATHS = {"alloc", "alloc_extend", "alloc_decode", "free", "free_swa", "free_segment", "free_swa_segment", "free_group_end", "clear"}
JUDGED_KINDS = (
    "allocator",
    "requests",
    "hybrid_requests",
    "metadata_allocator",
    "swa_allocator",
)  # map kinds whose ledger judges the class it hooks


@dataclasses.dataclass(frozen=True)
class PoolClass:
    name: str
    module: str
    standing: str  # "judged", "hooked, not judged", "not covered"
    why: str = ""


def _package_files(package: str) -> list[tuple[str, str]]:
    """(module name, path) of every .py file under an installed package."""
    top, _, rest = package.partition(".")
    init = module_source(top)
    root = os.path.join(os.path.dirname(init), *rest.split(".")) if init and rest else ""
    if not os.path.isdir(root):  # a namespace package has no __init__.py of its own: found from the top
        return []
    out = []
    for directory, _dirs, files in os.walk(root):
        for name in sorted(files):
            if name.endswith(".py"):
                relative = os.path.relpath(os.path.join(directory, name), root)[:-3].replace(os.sep, ".")
                module = package if relative == "__init__" else f"{package}.{relative.removesuffix('.__init__')}"
                out.append((module, os.path.join(directory, name)))
    return out


def _classes(path: str) -> list[ast.ClassDef]:
    try:
        with open(path, "rb") as fh:
            tree = ast.parse(fh.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return []
    return [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]


def _methods(node: ast.ClassDef) -> set[str]:
    return {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _base_names(node: ast.ClassDef) -> list[str]:
    names = []
    for base in node.bases:
        if isinstance(base, ast.Name):
            names.append(base.id)
        elif isinstance(base, ast.Attribute):
            names.append(base.attr)
    return names


def pool_classes(probe_map: ProbeMap) -> list[PoolClass]:
    """Every class named `*Allocator` or `*ReqToTokenPool` in the installed engine, with its standing."""
    found: dict[str, tuple[str, ast.ClassDef]] = {}
    for package in SCANNED_PACKAGES:
        for module, path in _package_files(package):
            for node in _classes(path):
                found.setdefault(node.name, (module, node))
    hooked = {spec.cls: spec for spec in probe_map.classes if spec.kind in JUDGED_KINDS}

    def mapped_ancestors(name: str, seen: frozenset[str] = frozenset()) -> list[str]:
        if name in seen or name not in found:
            return []
        out = []
        for base in _base_names(found[name][1]):
            if base in hooked:
                out.append(base)
            out += mapped_ancestors(base, seen | {name})
        return out

    def unmapped_ancestors(name: str, seen: frozenset[str] = frozenset()) -> list[str]:
        """The classes between `name` and the mapped ones: their methods override the hooks too."""
        if name in seen or name not in found:
            return []
        out = []
        for base in _base_names(found[name][1]):
            if base in found and base not in hooked:
                out += [base, *unmapped_ancestors(base, seen | {name})]
        return out

    parts = {part: why for spec in probe_map.classes for part, why in dict(spec.options.get("judges_parts") or {}).items()}
    out = []
    for name, (module, _node) in sorted(found.items()):
        if not name.endswith(POOL_SUFFIXES):
            continue
        if name in parts:  # a pool another class's ledger judges as its part
            out.append(PoolClass(name, module, "judged", str(parts[name])))
            continue
        if name in hooked:
            out.append(PoolClass(name, module, "judged"))
            continue
        ancestors = mapped_ancestors(name)
        if not ancestors:
            out.append(PoolClass(name, module, "not covered", "derives from no class the map hooks"))
            continue
        kinds = {hooked[a].kind for a in ancestors}
        swa = next((a for a in ancestors if hooked[a].kind == "swa_allocator"), "")
        if swa:
            paths = sorted({m for cls in [name, *unmapped_ancestors(name)] for m in _methods(found[cls][1])} & SWA_PATHS)
            why = f"derives from {swa} with its own {', '.join(paths) or 'methods'}: the SWA ledger follows {swa}'s free paths only"
            out.append(PoolClass(name, module, "hooked, not judged", why))
            continue
        if kinds <= {"requests", "hybrid_requests"}:
            own = {m for cls in [name, *unmapped_ancestors(name)] for m in _methods(found[cls][1])}
            overridden = sorted(own & {m for a in ancestors for m in hooked[a].methods})
            if not overridden:
                out.append(PoolClass(name, module, "judged", f"inherits {ancestors[0]}'s hooks"))
                continue
            out.append(PoolClass(name, module, "hooked, not judged", f"its own {', '.join(overridden)}"))
            continue
        out.append(PoolClass(name, module, "hooked, not judged", f"hooked through {ancestors[0]}, a pool the map does not describe"))
    return out


def summary(classes: list[PoolClass]) -> list[str]:
    """One line per standing, the classes named (those hooked but not judged with why)."""
    lines = []
    for standing in ("judged", "hooked, not judged", "not covered"):
        names = [f"{c.name} ({c.why})" if c.why and standing == "hooked, not judged" else c.name for c in classes if c.standing == standing]
        if names:
            lines.append(f"{standing} ({len(names)}): {', '.join(names)}")
    return lines
