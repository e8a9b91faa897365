"""The HTML report agrees with its findings, read back from the page real Chromium laid out: the
leak demo's ledger plot has a leaked band with the count its orphan_slots finding names (it said
"owned by requests 64" for the 64 slots the finding calls owned by no live request), a plot counts
its samples once (it said "2 samples" over an axis saying "one sample"), evidence times read as
times (not `1.7e+09`), and every label of every plot lies inside its frame."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO
from support.browser import CHROMIUM, chromium

from kvdoctor.analysis.replay import analyze_trace
from kvdoctor.formats.reports import render
from kvdoctor.trace import schema
from kvdoctor.trace.writer import TraceWriter, finish_trace

GIB = 1024**3

# Run in the page once it is laid out: each svg's box on the page and each of its labels' boxes, as
# drawn (rotated ones too), written into the DOM that --dump-dom prints.
MEASURE = """<script>
addEventListener("load", () => {
  const out = [...document.querySelectorAll("svg")].map((svg) => {
    const r = svg.getBoundingClientRect();
    const labels = [...svg.querySelectorAll("text")].map((t) => {
      const b = t.getBoundingClientRect();
      return {text: t.textContent, x: b.left, y: b.top, w: b.width, h: b.height};
    });
    return {label: svg.getAttribute("aria-label") || "", box: [r.left + scrollX, r.top + scrollY, r.width, r.height],
            frame: [r.left, r.top, r.width, r.height], labels};
  });
  const pre = document.createElement("pre");
  pre.id = "measured";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


def _text(dom: str) -> str:
    from html.parser import HTMLParser

    parts: list[str] = []
    parser = HTMLParser()
    parser.handle_data = parts.append
    parser.feed(re.sub(r"<(style|title|script|pre)[^>]*>.*?</\1>", " ", dom, flags=re.S))
    return " ".join(" ".join(parts).split())


def _laid_out(tmp_path, name: str, page: str) -> tuple[str, list[dict], str]:
    """The page's text and its measured plots as Chromium laid them out, and a screenshot of it."""
    path = tmp_path / f"{name}.html"
    path.write_text(page.replace("</body>", MEASURE + "</body>"), encoding="utf-8")
    window = "--window-size=1280,2400"  # both runs lay the page out alike: the boxes measured are the screenshot's
    dom = chromium(tmp_path, "--dump-dom", window, path.as_uri())
    measured = json.loads(re.search(r'<pre id="measured">(.*?)</pre>', dom, flags=re.S).group(1).replace("&quot;", '"'))
    png = tmp_path / f"{name}.png"
    chromium(tmp_path, f"--screenshot={png}", window, path.as_uri())
    return _text(dom), measured, str(png)


def _labels_inside(measured: list[dict]) -> None:
    assert measured, "no plot was drawn"
    for svg in measured:
        fx, fy, fw, fh = svg["frame"]
        for t in svg["labels"]:
            assert t["w"] > 0, t
            assert fx - 0.5 <= t["x"] and t["x"] + t["w"] <= fx + fw + 0.5, f"label outside the frame: {t} in {svg['frame']}"
            assert fy - 0.5 <= t["y"] and t["y"] + t["h"] <= fy + fh + 0.5, f"label outside the frame: {t} in {svg['frame']}"


def _samples_said_once(text: str) -> None:
    said = re.findall(r"\b(?:\d+|one) samples?\b", text)
    plots = text.count("KV slot ledger —") + text.count("Memory by class —")
    assert len(said) == plots, (said, text[-1500:])


@pytest.fixture(scope="module")
def leak_trace(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("leak") / "leak.kvtrace.json")
    proc = subprocess.run(
        [sys.executable, "-m", "kvdoctor.cli", "demo", "--fault", "leak", "--trace", path],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return path


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is not installed")
def test_the_leak_plots_legend_counts_the_leaked_slots_the_finding_names(leak_trace, tmp_path):
    analysis = analyze_trace(leak_trace)
    (orphan,) = [f for f in analysis.findings if f.kind == schema.ORPHAN_SLOTS]
    text, measured, png = _laid_out(tmp_path, "leak", render(analysis, "html"))

    legend = dict(
        (m.group(1), int(m.group(2)))
        for m in re.finditer(r"(leaked \(no live request\)|owned by live requests|owned by requests|free|in radix tree) (\d+)", text)
    )
    assert legend.get("leaked (no live request)") == orphan.count, (legend, text[-1500:])
    assert "owned by requests" not in legend, legend  # the slots no live request owns are not called owned
    assert (
        legend["owned by live requests"] + legend["leaked (no live request)"] + legend["free"] + legend["in radix tree"]
        == (orphan.evidence["total_slots"])
    ), legend
    assert f"orphan_slots ×{orphan.count} slots" in text
    _samples_said_once(text)
    _labels_inside(measured)

    # The screenshot: the leaked band is drawn, in its own colour, inside the ledger plot.
    from PIL import Image

    image = Image.open(png).convert("RGB")
    (ledger_plot,) = [m for m in measured if m["label"].startswith("KV slots of ")]  # the finding's swim-lanes are drawn too
    left, top, width, height = (int(v) for v in ledger_plot["box"])
    red = sum(
        1
        for x in range(left, left + width)
        for y in range(top, min(top + height, image.height))
        if image.getpixel((x, y)) == (0xDC, 0x26, 0x26)
    )
    assert red > 100, f"no leaked band in the plot ({red} pixels of its colour); see {png}"


def _growth_trace(path: str) -> str:
    writer = TraceWriter(path)
    events = [schema.header_event(pid=7, engine="", engine_version="", process_title="sglang::scheduler")]
    t0 = 1_700_000_000e6
    for i in range(600):
        anon = 2 * GIB + 10 * GIB / 3600.0 * i + (i % 5) * 2**20
        args = {"anon_bytes": int(anon), "rss_bytes": int(anon + 800 * 2**20)}
        events.append(schema.Event(ph="C", name=schema.MEMORY_COUNTER, pid=7, ts=t0 + i * 1e6, cat=schema.CAT_SAMPLER, args=args))
    writer.write_batch(events)
    writer.close()
    finish_trace(path, 7)
    return path


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is not installed")
def test_a_growth_plot_says_times_as_times_and_keeps_its_trend_label_inside(tmp_path):
    analysis = analyze_trace(_growth_trace(str(tmp_path / "grow.kvtrace.json")))
    (growth,) = [f for f in analysis.findings if f.kind == schema.MEMORY_GROWTH]
    text, measured, _png = _laid_out(tmp_path, "grow", render(analysis, "html"))
    assert "window_start_s 2023-11-14 22:" in text, text[:3000]
    assert not re.search(r"(start|end)_s \d\.\d+e\+", text), text[:3000]  # a time is no float
    assert any(t["text"].startswith("trend ") for svg in measured for t in svg["labels"]), measured
    _samples_said_once(text)
    _labels_inside(measured)
    assert growth.count == 1 and "not judged" not in text  # a growth its finding names is judged
