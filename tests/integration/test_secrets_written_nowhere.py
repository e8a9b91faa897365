"""Secrets on a command line are written nowhere: not in the trace, its reports, the Prometheus
metrics, nor the memray captures the probe keeps beside the trace (which are private, like it and
the tracemalloc snapshots).

Real processes throughout: `kvdoctor run` of a Python command carrying the secrets (the sampler
reads its process title from /proc, the probe reads its own), and a child with memray windows.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import textwrap
import time
import tracemalloc

import pytest
from conftest import REPO, trace_events

from kvdoctor.formats.live.prometheus import MetricsState, render_text
from kvdoctor.trace import schema
from kvdoctor.trace.reader import iter_events
from kvdoctor.trace.writer import redact, redact_args

# Each secret is a distinct word, so a leak names which form let it through.
SECRET_ARGS = [
    "-H",
    "Authorization: Bearer SECRETBEARER1",
    "--header=Authorization: Basic SECRETBASIC2",
    "--url",
    "https://alice:SECRETURLPASS3@models.example/v1",
    "--model-loader-extra-config",
    '{"token": "SECRETJSON4", "api_key": "SECRETJSON5", "nested": {"password": 12345678}}',
    "-k",
    "SECRETSHORTK6",
    "--auth",
    "SECRETAUTH7",
    "--auth=SECRETAUTH8",
    "--api-key",
    "SECRETAPIKEY9",
    "X-Api-Key: SECRETHEADER10",
    "postgres://bob:SECRETDBPASS11@db:5432/x",
    "--max-total-tokens",
    "4096",
]
SECRETS = re.findall(r"SECRET[A-Z]+\d+", " ".join(SECRET_ARGS)) + ["12345678"]

# The demo's workload imports an engine (so the probe starts and writes its own header and title),
# then lingers so the sampler sees the process too. `python -c "import workload" SECRETS...`.
WORKLOAD = (
    "import time\n"
    "from kvdoctor.demo.workload import WorkloadConfig, run_workload\n"
    "run_workload(WorkloadConfig(fault='none', turns=2))\n"
    "time.sleep(2.5)\n"
)


def kv(*args: str, cwd=None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvdoctor.cli", *args], capture_output=True, text=True, cwd=cwd or REPO, timeout=timeout)


def assert_no_secret(text: str, where: str) -> None:
    leaked = [s for s in SECRETS if s in text]
    assert not leaked, f"{where} holds {leaked}"


def test_redaction_keeps_what_is_not_a_secret():
    shown = redact_args(SECRET_ARGS)
    assert_no_secret(" ".join(shown), "redact_args")
    assert_no_secret(redact(" ".join(SECRET_ARGS)), "redact")
    assert shown[shown.index("--max-total-tokens") + 1] == "4096"
    assert "https://alice:***@models.example/v1" in shown and "Authorization: Bearer ***" in shown
    assert redact(redact(" ".join(SECRET_ARGS))) == redact(" ".join(SECRET_ARGS))
    for plain in ("--max-tokens 100", "--author bob", "--tokenizer-path /m", "--keyfile /etc/k.pem", "http://host:8000/v1"):
        assert redact(plain) == plain and redact_args(plain.split()) == plain.split()


def test_secrets_on_a_command_line_reach_no_trace_report_or_metric(tmp_path):
    (tmp_path / "workload.py").write_text(WORKLOAD)
    trace = tmp_path / "t.kvtrace.json"
    command = [sys.executable, "-c", "import workload", *SECRET_ARGS]
    proc = kv("run", "--trace", str(trace), "--sample-interval", "0.2", "--", *command, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_no_secret(trace.read_text(), "the trace")
    assert_no_secret(proc.stderr, "run's summary")
    headers = [e.args for e in iter_events(str(trace)) if e.name == schema.HEADER]
    probed = [h["process_title"] for h in headers if h.get("probe") == "kvdoctor"]
    sampled = [h["process_title"] for h in headers if h.get("source") == "sampler" and "import workload" in h["process_title"]]
    assert probed and sampled, headers
    assert all("-c import workload -H Authorization: Bearer ***" in title for title in probed + sampled), probed + sampled

    for fmt in ("text", "json", "html"):
        report = tmp_path / f"r.{fmt}"
        replay = kv("replay", str(trace), "--format", fmt, "-o", str(report))
        assert replay.returncode == 0, replay.stderr
        assert_no_secret(report.read_text(), f"the {fmt} report")

    state = MetricsState()
    state.feed(list(iter_events(str(trace))))
    metrics = render_text(state).decode()
    assert "import workload -H Authorization: Bearer ***" in metrics
    assert_no_secret(metrics, "the Prometheus metrics")


# ---------------------------------------------------------------- attribution files

try:
    import memray
except ImportError:
    memray = None

GROWER = textwrap.dedent(
    """
    import sys, threading, time
    from kvdoctor.probe.core import runtime
    held = []
    def grow():
        while len(held) < 400:
            held.append(bytearray(256 * 1024))
            time.sleep(0.01)
    threading.Thread(target=grow, name="grower", daemon=True).start()
    runtime.activate()
    print("ready", flush=True)
    sys.stdin.read()
    """
)


def _attribution_child(tmp_path, engine: str, key: str) -> tuple[str, list[str]]:
    """Runs GROWER with `engine`'s windows and the secrets on its command line until two windows
    kept their files (listed under `key` in the event), then lets it exit; the trace and those files."""
    trace = str(tmp_path / "m.kvtrace.json")
    script = tmp_path / "grower.py"
    script.write_text(GROWER)
    env = dict(
        os.environ,
        KVDOCTOR_TRACE=trace,
        KVDOCTOR_ATTRIBUTION=engine,
        KVDOCTOR_ATTRIBUTION_PERIOD_S="1.0",
        KVDOCTOR_ATTRIBUTION_WINDOW_S="0.5",
        PYTHONPATH=REPO,
    )
    child = subprocess.Popen(
        [sys.executable, str(script), *SECRET_ARGS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=str(tmp_path)
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        kept: list[str] = []
        while time.monotonic() < deadline and len(kept) < 2:
            time.sleep(0.3)
            kept = [p for e in trace_events(trace, schema.HOST_GROWTH_SITES) for p in e["args"][key]]
        child.stdin.close()
        assert child.wait(timeout=60) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert len(kept) >= 2, f"no {engine} window kept a file within 60 s"
    on_disk = sorted(os.path.join(tmp_path, name) for name in os.listdir(tmp_path) if name.startswith("m.kvtrace.json"))
    assert [name for name in os.listdir(tmp_path) if name.startswith(".")] == []  # no scratch left behind
    for path in on_disk:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    return trace, on_disk


@pytest.mark.skipif(memray is None and not os.environ.get("CI"), reason="memray is not installed (.ci/setup installs it)")
def test_memray_captures_are_private_and_carry_no_secret(tmp_path):
    trace, on_disk = _attribution_child(tmp_path, "memray", "captures")
    captures = [path for path in on_disk if path != trace]
    assert captures and all(path.startswith(trace + ".memray.") for path in captures), on_disk
    for path in captures:
        with memray.FileReader(path) as reader:
            command_line = reader.metadata.command_line
            assert sum(r.size for r in reader.get_leaked_allocation_records(merge_threads=True)) > 0
        assert "--api-key ***" in command_line and "grower.py" in command_line, command_line
        assert_no_secret(command_line, f"{path}'s command line")
        with open(path, "rb") as fh:
            assert_no_secret(fh.read().decode("latin-1"), path)


def test_tracemalloc_snapshots_are_private_like_the_trace(tmp_path):
    trace, on_disk = _attribution_child(tmp_path, "tracemalloc", "snapshots")
    snapshots = [path for path in on_disk if path != trace]
    assert snapshots and all(path.startswith(trace + ".tracemalloc.") for path in snapshots), on_disk
    assert tracemalloc.Snapshot.load(snapshots[-1]).traces
