import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
from conftest import REPO
from support.browser import CHROMIUM, chromium

from kvdoctor.analysis.budgets import Budgets
from kvdoctor.analysis.gate import judge
from kvdoctor.analysis.replay import analyze_trace
from kvdoctor.commands.gate import gate
from kvdoctor.errors import KvdoctorError
from kvdoctor.formats.reports.html import render_html
from kvdoctor.trace import schema
from kvdoctor.trace.writer import TraceWriter, finish_trace
from kvdoctor.units import parse_rate, parse_size

MIB = 1024 * 1024
GIB = 1024 * MIB


def _env():
    env = dict(os.environ)
    env.pop("KVDOCTOR_TRACE", None)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


@pytest.fixture(scope="module")
def demo_traces(tmp_path_factory):
    out = {}
    base = tmp_path_factory.mktemp("demo")
    procs = {}
    for fault in ("leak", "none"):
        path = str(base / f"{fault}.kvtrace.json")
        procs[fault] = (
            path,
            subprocess.Popen(
                [sys.executable, "-m", "kvdoctor.cli", "demo", "--fault", fault, "--trace", path],
                cwd=str(base),
                env=_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            ),
        )
    for fault, (path, proc) in procs.items():
        text, _ = proc.communicate(timeout=300)
        assert os.path.exists(path), text[-2000:]
        out[fault] = path
    return out


def _junit_cases(path):
    suite = ET.parse(path).getroot().find("testsuite")
    assert suite.get("name") == "kvdoctor-gate"
    return {case.get("name"): case for case in suite.findall("testcase")}


def test_gate_leak_trace_fails_on_orphan_slots(demo_traces, tmp_path, capsys):
    junit = str(tmp_path / "gate.xml")
    assert gate([demo_traces["leak"]], junit=junit) == 1
    cases = _junit_cases(junit)
    assert cases["max-orphan-slots"].find("failure") is not None
    assert "64 orphaned" in cases["max-orphan-slots"].find("failure").get("message")
    assert cases["no-double_free"].find("failure") is None
    out = capsys.readouterr().out
    assert "FAIL  max-orphan-slots" in out and "kvdoctor gate: FAIL" in out


def test_gate_clean_trace_holds_every_budget_it_can_judge(demo_traces, tmp_path):
    """The demo's trace has no sampler's memory: its growth budget is not judged (2, and the JUnit
    case an error), never a pass; every other budget holds."""
    junit = str(tmp_path / "gate.xml")
    html = str(tmp_path / "report.html")
    assert gate([demo_traces["none"]], junit=junit, html=html) == 2
    cases = _junit_cases(junit)
    assert {"max-growth", "max-orphan-slots", "no-double_free", "no-double_alloc"} <= set(cases)
    assert cases["max-growth"].find("error").get("type") == "could-not-judge"
    assert "no memory sample" in cases["max-growth"].find("error").get("message")
    others = [c for name, c in cases.items() if name != "max-growth"]
    assert all(c.find("failure") is None and c.find("error") is None for c in others)
    assert "<svg" in open(html, encoding="utf-8").read()


def test_baseline_regression(demo_traces):
    leak, clean = analyze_trace(demo_traces["leak"]), analyze_trace(demo_traces["none"])
    lenient = Budgets(max_orphan_slots=1000)
    same = judge(leak, lenient, baseline=leak)
    assert not same.failed and [c.name for c in same.unjudged] == ["max-growth"]  # no memory sample to judge growth on
    result = judge(leak, lenient, baseline=clean)
    check = {c.name: c for c in result.checks}["baseline-regression"]
    assert not check.passed and "orphaned slots 64 vs baseline 0" in check.detail


WORKLOAD = "from kvdoctor.demo.workload import WorkloadConfig, run_workload; run_workload(WorkloadConfig(fault={!r}))"


@pytest.mark.parametrize("fault,expected", [("leak", 1), ("none", 2)])  # none: a few seconds, growth not judged
def test_gate_command_runs_under_probe(fault, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KVDOCTOR_TRACE", raising=False)
    monkeypatch.setenv("PYTHONPATH", REPO)
    trace = str(tmp_path / "cmd.kvtrace.json")
    code = gate([sys.executable, "-c", WORKLOAD.format(fault)], trace=trace, junit=str(tmp_path / "j.xml"))
    assert code == expected
    cases = _junit_cases(str(tmp_path / "j.xml"))
    failed = [n for n, c in cases.items() if c.find("failure") is not None]
    assert failed == (["max-orphan-slots"] if fault == "leak" else [])
    assert [n for n, c in cases.items() if c.find("error") is not None] == ["max-growth"]


def test_a_command_whose_probe_never_reported_fails_the_gate(tmp_path, monkeypatch, capsys):
    """No engine came up under the probe (the benchmark never started its server): a gate that
    passes that is worse than none."""
    monkeypatch.chdir(tmp_path)
    assert gate(["true"], trace=str(tmp_path / "t.kvtrace.json")) == 1
    out = capsys.readouterr().out
    assert "FAIL  probe-reported: no probe reported from an engine" in out


def test_gate_command_not_found(tmp_path):
    with pytest.raises(KvdoctorError) as info:
        gate(["no-such-command-kvdoctor"], trace=str(tmp_path / "t.kvtrace.json"))
    assert info.value.exit_code == 2


# --- growth budgets on synthetic memory traces ------------------------------------------------


def _memory_trace(path, anon_at):
    writer = TraceWriter(path)
    # what `kvdoctor watch` records: memory from outside, no probe (so no slot ledger to judge)
    events = [schema.header_event(pid=7, engine="", engine_version="", process_title="sglang::scheduler")]
    t0 = 1_700_000_000e6
    for i in range(600):
        anon = anon_at(float(i))
        events.append(
            schema.Event(
                ph="C",
                name=schema.MEMORY_COUNTER,
                pid=7,
                ts=t0 + i * 1e6,
                cat=schema.CAT_SAMPLER,
                args={"anon_bytes": int(anon), "rss_bytes": int(anon + 800 * MIB)},
            )
        )
    writer.write_batch(events)
    writer.close()
    finish_trace(path, 7)
    return path


def test_growing_memory_breaks_growth_budget(tmp_path):
    rate = 10 * GIB / 3600.0
    path = _memory_trace(str(tmp_path / "grow.kvtrace.json"), lambda t: 2 * GIB + rate * t + (int(t) % 5) * MIB)
    analysis = analyze_trace(path)
    assert any(f.kind == "memory_growth" for f in analysis.findings)
    junit = str(tmp_path / "j.xml")
    assert gate([path], max_growth="500MiB/h", junit=junit, html=str(tmp_path / "g.html")) == 1
    assert _junit_cases(junit)["max-growth"].find("failure") is not None
    assert gate([path], max_growth="20GiB/h") == 0


def test_plateau_passes_growth_budget(tmp_path):
    path = _memory_trace(str(tmp_path / "flat.kvtrace.json"), lambda t: 2 * GIB + min(t, 90.0) * 20 * MIB + (int(t) % 7) * MIB)
    assert gate([path], max_growth="500MiB/h") == 0


# --- units ------------------------------------------------------------------------------------


def test_parse_size_units():
    assert parse_size("0") == 0
    assert parse_size("500MiB") == 500 * MIB
    assert parse_size("1.5GiB") == int(1.5 * GIB)
    assert parse_size("10GB") == 10 * 1000**3
    assert parse_size("2k") == 2048
    assert parse_size(" 7 B ") == 7


def test_parse_rate_units():
    assert parse_rate("500MiB/h") == pytest.approx(500 * MIB / 3600)
    assert parse_rate("10MB/s") == pytest.approx(10e6)
    assert parse_rate("1GiB/hour") == pytest.approx(GIB / 3600)
    assert parse_rate("60KiB/min") == pytest.approx(1024)
    assert parse_rate("2GiB/hours") == pytest.approx(2 * GIB / 3600)


@pytest.mark.parametrize("bad", ["", "MiB", "12 parsecs", "1.2.3G", "-5MiB", "five"])
def test_parse_size_rejects(bad):
    with pytest.raises(KvdoctorError):
        parse_size(bad)


@pytest.mark.parametrize("bad", ["500MiB", "500MiB/fortnight", "x/h", "/h"])
def test_parse_rate_rejects(bad):
    with pytest.raises(KvdoctorError) as info:
        parse_rate(bad)
    assert info.value.message


# --- HTML -------------------------------------------------------------------------------------


def _rendered_text(dom):
    from html.parser import HTMLParser

    parts = []
    parser = HTMLParser()
    parser.handle_data = parts.append
    parser.feed(re.sub(r"<(style|title)[^>]*>.*?</\1>", " ", dom, flags=re.S))
    return " ".join(" ".join(parts).split())


def test_html_report_and_screenshot(demo_traces, tmp_path):
    analysis = analyze_trace(demo_traces["leak"])
    page = render_html(analysis)
    html_path = tmp_path / "report.html"
    html_path.write_text(page, encoding="utf-8")
    assert "<svg" in page and "orphan_slots" in page and "64 KV slot(s) leaked" in page
    assert "<script" not in page and "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is not installed: no screenshot of the report")
    url = html_path.as_uri()

    # What the browser parsed: the finding's kind, count and message are in the page's text.
    text = _rendered_text(chromium(tmp_path, "--dump-dom", url))
    assert "orphan_slots ×64" in text and "64 KV slot(s) leaked" in text, text[:2000]
    assert "1 error finding(s)" in text

    # What it drew: a full-size screenshot with text and the ledger plot laid out down the page.
    width, height = 1280, 1600
    png = tmp_path / "report.png"
    chromium(tmp_path, f"--screenshot={png}", f"--window-size={width},{height}", url)
    from PIL import Image

    image = Image.open(png).convert("RGB")
    assert image.size == (width, height)
    colours = image.getcolors(maxcolors=width * height)
    background_share = max(colours)[0] / (width * height)
    assert len(colours) > 64 and background_share < 0.9, f"{len(colours)} colours, background {background_share:.0%}"
    background = max(colours)[1]
    ink_rows = [y for y in range(0, height, 4) if sum(1 for x in range(0, width, 4) if image.getpixel((x, y)) != background) > 8]
    assert ink_rows and ink_rows[0] < 100 and ink_rows[-1] > height // 2, "the report is not laid out down the page"


def test_a_growth_budget_below_the_detectors_own_floor_is_the_budget(tmp_path):
    """A steady 40 MiB/h is below the growth test's default floor (50 MiB/h: not urgent on its
    own), but a user who sets --max-growth 10MiB/h gets 10 MiB/h."""
    rate = 40 * MIB / 3600.0
    path = _memory_trace(str(tmp_path / "slow.kvtrace.json"), lambda t: 2 * GIB + rate * t)
    assert not any(f.kind == "memory_growth" for f in analyze_trace(path).findings)  # the default floor
    assert gate([path], max_growth="10MiB/h") == 1
    assert gate([path], max_growth="60MiB/h") == 0
