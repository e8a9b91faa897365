"""What a user installs: every module and map is in the wheel, every package it imports is declared,
and what is declared is used."""

import ast
import os
import re
import subprocess
import sys
import zipfile

import pytest
from conftest import REPO

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

# Imported only where they are optional: each import sits in a try block or a function that says
# how to get it (extras), or belongs to the engine being probed.
OPTIONAL = {"orjson", "triton", "pandas", "pyarrow", "prometheus_client", "pynvml", "memray", "torch", "sglang", "vllm"}
DISTRIBUTION_OF = {"pynvml": "nvidia-ml-py", "prometheus_client": "prometheus_client"}


def _pyproject():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as fh:
        return tomllib.load(fh)


def _requirement_names(requirements):
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].strip().lower().replace("_", "-") for r in requirements}


def _third_party_imports():
    """The top-level packages kvdoctor's modules import, wherever the import stands."""
    std = set(sys.stdlib_module_names)
    found = set()
    for folder, _dirs, files in os.walk(os.path.join(REPO, "kvdoctor")):
        for name in files:
            if not name.endswith(".py"):
                continue
            tree = ast.parse(open(os.path.join(folder, name)).read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    roots = [a.name.split(".")[0] for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    roots = [node.module.split(".")[0]]
                else:
                    continue
                for root in roots:
                    if root not in std and root not in ("kvdoctor", "__future__", "sitecustomize"):
                        found.add(root)
    return found


def test_every_package_directory_is_listed():
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    on_disk = {
        os.path.relpath(folder, REPO).replace(os.sep, ".")
        for folder, _dirs, files in os.walk(os.path.join(REPO, "kvdoctor"))
        if any(f.endswith(".py") for f in files)
    }
    assert on_disk | {"kvdoctor.probes"} == listed


def test_what_is_imported_is_declared_and_what_is_declared_is_imported():
    project = _pyproject()["project"]
    required = _requirement_names(project["dependencies"])
    extras = set().union(*(_requirement_names(v) for v in project["optional-dependencies"].values()))
    imported = _third_party_imports()
    for root in imported:
        dist = DISTRIBUTION_OF.get(root, root).lower().replace("_", "-")
        if root in OPTIONAL:
            assert dist in extras | {"torch", "sglang", "vllm"}, f"{root} is optional but no extra installs it"
        else:
            assert dist in required, f"kvdoctor imports {root} but does not declare it"
    assert required - {"tomli"} <= {DISTRIBUTION_OF.get(r, r).lower().replace("_", "-") for r in imported}, "a dependency nothing imports"
    assert any("tomli" in r and "python_version < '3.11'" in r for r in project["dependencies"])  # maps on Python 3.10


@pytest.mark.slow
def test_the_wheel_carries_every_module_the_maps_and_the_injected_sitecustomize(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), REPO],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = [p for p in os.listdir(tmp_path) if p.endswith(".whl")]
    names = set(zipfile.ZipFile(tmp_path / wheel).namelist())
    sources = {
        os.path.relpath(os.path.join(folder, f), REPO)
        for folder, _dirs, files in os.walk(os.path.join(REPO, "kvdoctor"))
        for f in files
        if f.endswith(".py")
    }
    assert sources <= names
    maps = {f for f in os.listdir(os.path.join(REPO, "probes")) if f.endswith(".toml")}
    assert {f"kvdoctor/probes/{m}" for m in maps} <= names and maps
    assert "kvdoctor/delivery/pythonpath/sitecustomize.py" in names
    assert {"kvdoctor/fleet/alerts.yml", "kvdoctor/fleet/dashboard.json"} <= names  # the fleet's rules and dashboard
    # the native path is built into the wheel where a compiler is present (it is here)
    assert [n for n in names if n.startswith("kvdoctor/probe/native/_native") and n.endswith(".so")], sorted(names)
