"""One unit per count: a finding's count is in the unit it names, slots for the KV slot rules, with
the pages said where the page size is above one, the same in the terminal line, its sentence and
the JSON. At page size 4 `double_alloc x1: ... (slots 792, 793, 794, 795)` counted a page start
while it listed four slots; now it is `double_alloc x4 slots (1 page of 4): 4 KV slot(s) ...`."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import REPO

PAGED = {"double_alloc", "double_free", "use_after_free", "orphan_slots"}


def demo(tmp_path, fault: str, page_size: int, fmt: str) -> str:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvdoctor.cli",
            "demo",
            "--fault",
            fault,
            "--page-size",
            str(page_size),
            "--format",
            fmt,
            "--trace",
            str(tmp_path / f"{fmt}.kvtrace.json"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.parametrize("fault", ["double-alloc", "stale-last-loc"])
def test_a_paged_count_is_slots_and_says_its_pages(fault, tmp_path):
    findings = json.loads(demo(tmp_path, fault, 4, "json"))["findings"]
    slot_findings = [f for f in findings if f["kind"] in PAGED]
    assert slot_findings, findings
    for f in slot_findings:
        assert f["unit"] == "slots" and f["page_size"] == 4, f
        assert f["count"] % 4 == 0, f  # whole pages: the ledger keeps one state a page
        assert f["message"].startswith(f"{f['count']} "), f  # the sentence counts what the count counts
        assert len(f["evidence"]["slot_ids"]) <= f["count"], f
    for f in findings:
        assert f.get("unit"), f  # every count names its unit
    lines = [line for line in demo(tmp_path, fault, 4, "text").splitlines() if line.startswith("ERROR ")]
    assert len(lines) == len(findings)
    for line, f in zip(lines, findings, strict=True):
        head = line.split(": ", 1)[0]
        pages = f["count"] // 4
        expected = (
            f"{f['count']} slots ({pages} page{'' if pages == 1 else 's'} of 4)" if f["kind"] in PAGED else f"{f['count']} {f['unit']}"
        )
        assert head == f"ERROR {f['kind']} x{expected}", (line, f)
        caused = re.search(r"caused by \S+ x\d+ (slots|last_loc values)", line)
        assert "caused by" not in line or caused, line  # the cause's count names its unit too


def test_at_page_size_one_no_pages_are_said(tmp_path):
    findings = json.loads(demo(tmp_path, "double-free", 1, "json"))["findings"]
    assert findings and all(f["unit"] == "slots" and "page_size" not in f for f in findings), findings
    first = next(line for line in demo(tmp_path, "double-free", 1, "text").splitlines() if line.startswith("ERROR "))
    assert first.startswith(f"ERROR double_free x{findings[0]['count']} slots: "), first
