"""The docs say what the tree says: the generated parts (the release table from probes/, the
benchmark tables from bench/results and reports/gpu/results.json, the finding examples from the
committed reports, docs/gpu.md from reports/gpu/SUMMARY.md) are what docs/generate.py makes now;
every finding kind has its entry in docs/findings.md; the README stays a front page."""

from __future__ import annotations

import importlib.util
import os
import re
import sys

import pytest

from kvdoctor.trace.schema import FINDING_KINDS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests", "support"))

import readme_gate  # noqa: E402


def _generate():
    spec = importlib.util.spec_from_file_location("docs_generate", os.path.join(REPO, "docs", "generate.py"))
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _read(rel: str) -> str:
    with open(os.path.join(REPO, rel), encoding="utf-8") as fh:
        return fh.read()


def test_the_generated_pages_are_not_stale():
    assert _generate().stale() == [], "run .venv/bin/python docs/generate.py and commit what it changes"


def test_a_changed_source_makes_its_page_stale(monkeypatch):
    """The check compares with the data, not with itself: a release table made from other maps, or
    a report with another finding, no longer matches the committed page."""
    generate = _generate()
    monkeypatch.setitem(generate.GENERATORS, "probes-table", lambda: "| releases |\n|---|\n| 9.9.9 |")
    assert generate.stale() == ["docs/supported.md"]
    real_read = generate._read
    monkeypatch.setattr(
        generate, "_read", lambda rel: real_read(rel).replace("x64", "x65") if rel == "reports/demo/leak.txt" else real_read(rel)
    )
    assert set(generate.stale()) == {"README.md", "docs/index.md", "docs/findings.md", "docs/supported.md"}


def test_every_finding_kind_has_its_entry_in_the_reference():
    page = _read("docs/findings.md")
    headings = set(re.findall(r"^### `([a-z0-9_]+)`$", page, flags=re.M))
    assert set(FINDING_KINDS) <= headings, sorted(set(FINDING_KINDS) - headings)
    assert headings <= set(FINDING_KINDS), sorted(headings - set(FINDING_KINDS))


def test_the_readme_is_a_front_page_with_its_two_commands():
    readme = _read("README.md")
    assert len(readme.encode()) <= 15 * 1024
    assert "```bash\nbash .ci/setup && .venv/bin/kvdoctor demo\nbash .ci/test\n```" in readme
    assert "bash .ci/test" in _read(".ci/run")  # CI runs the README's second command
    for line in ("pip install <path-to-kvdoctor-checkout>", "kvdoctor run --trace sglang.kvtrace.json -- python -m sglang.launch_server"):
        assert line in readme


def test_the_readme_links_only_pages_that_exist():
    readme = _read("README.md")
    for target in re.findall(r"\]\((docs/[^)#\s]+)", readme):
        assert os.path.exists(os.path.join(REPO, target)), target


@pytest.mark.parametrize("first_line, gates", [("# bench.sh", 2), ("# vllm-bench.sh", 1)])
def test_the_ci_gate_page_has_the_scripts_the_gate_tests_run(first_line, gates):
    """tests/e2e/test_readme_gate.py runs these on real servers; this says at once, without a server,
    when an edit of docs/ci-gate.md loses them."""
    script, lines = readme_gate.example(first_line)
    assert script.startswith(first_line) and len(lines) == gates, lines
