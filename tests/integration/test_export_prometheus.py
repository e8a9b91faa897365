"""`kvdoctor export` (CSV and Parquet from a real demo trace) and `kvdoctor watch --prometheus`
(scraped over HTTP while it watches a real child process that allocates memory)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request

import pytest

pd = pytest.importorskip("pandas")
pytest.importorskip("pyarrow")
parser = pytest.importorskip("prometheus_client.parser")

from conftest import REPO  # noqa: E402

from kvdoctor.analysis.findings import ERROR, Finding  # noqa: E402
from kvdoctor.commands.export import export  # noqa: E402
from kvdoctor.errors import KvdoctorError  # noqa: E402
from kvdoctor.formats.counter_table import iter_frames, scan_columns  # noqa: E402
from kvdoctor.formats.live.prometheus import MetricsState, _client_renderer, parse_address, render_text  # noqa: E402
from kvdoctor.trace import schema  # noqa: E402
from kvdoctor.trace.reader import iter_events  # noqa: E402


def _cli(*args: str, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("KVDOCTOR_TRACE", None)
    return subprocess.run(
        [sys.executable, "-m", "kvdoctor.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env, **kwargs
    )


@pytest.fixture(scope="module")
def demo_trace(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("export") / "demo.kvtrace.json")
    proc = _cli("demo", "--fault", "leak", "--trace", path, timeout=120)
    assert os.path.getsize(path) > 0, proc.stderr[-2000:]
    return path


# --------------------------------------------------------------------------- export


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_export_demo_trace_reads_back(demo_trace, tmp_path, fmt):
    out = str(tmp_path / f"counters.{fmt}")
    proc = _cli("export", demo_trace, "--format", fmt, "-o", out)
    assert proc.returncode == 0, proc.stderr
    df = pd.read_csv(out) if fmt == "csv" else pd.read_parquet(out)
    assert len(df) > 0
    for column in ("ts_s", "pid", "name", "allocator", "free_slots"):
        assert column in df.columns
    ledger = df[df["name"] == schema.LEDGER_COUNTER]
    assert len(ledger) > 0 and ledger["free_slots"].notna().all()
    assert set(df["name"]) <= {"kv_slots", "memory", "memory_classes", "hicache", "l3_store", "probe_stats"}
    assert schema.MEMORY_CLASSES in set(df["name"])  # the probe's own split of anonymous memory
    # the same counters as the trace holds, row for row
    expected = [e for e in iter_events(demo_trace) if e.ph == "C" and e.name == schema.LEDGER_COUNTER]
    assert list(ledger["free_slots"].astype(int)) == [e.args["free_slots"] for e in expected]
    assert ledger["ts_s"].iloc[0] == pytest.approx(expected[0].ts / 1e6)


def test_export_default_path_and_chunks(demo_trace, tmp_path):
    columns, rows, _ = scan_columns(demo_trace)
    frames = list(iter_frames(demo_trace, columns, chunk_rows=1))
    assert rows > 1 and len(frames) == rows and all(len(f) == 1 for f in frames)
    assert len({tuple(f.columns) for f in frames}) == 1
    trace = tmp_path / "copy.kvtrace.json"
    trace.write_bytes(open(demo_trace, "rb").read())
    assert export(str(trace), "csv", chunk_rows=1) == 0
    df = pd.read_csv(tmp_path / "copy.csv")
    assert len(df) == rows


def test_export_garbage_is_one_line_exit_2(tmp_path):
    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(b"\x00not a trace at all\n" * 10)
    proc = _cli("export", str(garbage), "--format", "csv", "-o", str(tmp_path / "x.csv"))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvdoctor:") and "Traceback" not in proc.stderr
    assert not (tmp_path / "x.csv").exists()
    with pytest.raises(KvdoctorError):
        export(str(tmp_path / "missing.json"), "csv", str(tmp_path / "y.csv"))


def test_export_without_pandas_names_the_extra(demo_trace, tmp_path):
    code = (
        "import sys; sys.modules['pandas'] = None; sys.modules['pyarrow'] = None; "
        "from kvdoctor.cli import main; sys.argv = ['kvdoctor'] + sys.argv[1:]; main()"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "export", demo_trace, "--format", "parquet", "-o", str(tmp_path / "z.parquet")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'kvdoctor[export]'" in lines[0], proc.stderr


# --------------------------------------------------------------------------- prometheus


def _families(text: str) -> dict:
    return {f.name: f for f in parser.text_string_to_metric_families(text)}


def _state() -> MetricsState:
    state = MetricsState()
    state.feed(
        [
            schema.Event(
                ph="C",
                name=schema.MEMORY_COUNTER,
                pid=41,
                ts=1e15,
                args={"rss_bytes": 300, "anon_bytes": 200, "pinned_bytes": 64, "title": '/usr/bin/python3  "serve"\nx'},
            ),
            schema.Event(
                ph="C",
                name=schema.LEDGER_COUNTER,
                pid=42,
                ts=1e15,
                args={"allocator": "TokenToKVPoolAllocator#0", "total_slots": 2048, "free_slots": 128, "owned_slots": 64},
            ),
        ]
    )
    growth = Finding(
        kind="memory_growth", severity=ERROR, message="grows", count=1, pid=41, evidence={"memory_class": "anon", "bytes_per_s": 1234.5}
    )
    state.set_findings([growth])
    state.set_findings([growth])  # the same finding again is not counted twice
    return state


@pytest.mark.parametrize("renderer", ["prometheus_client", "hand-written"])
def test_exposition_parses(renderer):
    state = _state()
    body = (_client_renderer(state)() if renderer == "prometheus_client" else render_text(state)).decode()
    families = _families(body)
    memory = families["kvdoctor:memory_bytes"]
    by_class = {s.labels["class"]: s.value for s in memory.samples}
    assert by_class == {"rss": 300, "anon": 200, "pinned": 64}
    assert {s.labels["pid"] for s in memory.samples} == {"41"}
    assert memory.samples[0].labels["title"] == 'python3 "serve" x'
    rate = families["kvdoctor:memory_growth_bytes_per_second"].samples
    assert [(s.labels, s.value) for s in rate] == [({"pid": "41", "class": "anon"}, 1234.5)]
    slots = {s.labels["state"]: s.value for s in families["kvdoctor:kv_slots"].samples}
    assert slots == {"total": 2048, "free": 128, "owned": 64}
    findings = families["kvdoctor:findings"]
    assert findings.type == "counter"
    assert [(s.name, s.labels, s.value) for s in findings.samples if s.name.endswith("_total")] == [
        ("kvdoctor:findings_total", {"kind": "memory_growth", "severity": "error"}, 1.0)
    ]


def test_parse_address_refuses_public_hosts():
    assert parse_address("127.0.0.1:9400") == ("127.0.0.1", 9400)
    assert parse_address(":9400") == ("127.0.0.1", 9400)
    assert parse_address("9400") == ("127.0.0.1", 9400)
    assert parse_address("[::1]:9400") == ("::1", 9400)
    assert parse_address("0.0.0.0:9400", public=True) == ("0.0.0.0", 9400)
    for bad in ("0.0.0.0:9400", "127.0.0.1", "127.0.0.1:70000", "::1:9400"):
        with pytest.raises(KvdoctorError):
            parse_address(bad)


GROWER = textwrap.dedent(
    """
    import time
    held = []
    print("ready", flush=True)
    for _ in range(400):
        held.append(b"x" * (1 << 20))
        time.sleep(0.03)
    time.sleep(60)
    """
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_watch_serves_prometheus_metrics(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", GROWER], stdout=subprocess.PIPE, text=True)
    watcher = None
    try:
        assert child.stdout.readline().strip() == "ready"
        port = _free_port()
        url = f"http://127.0.0.1:{port}/metrics"
        env = dict(os.environ)
        env.pop("KVDOCTOR_TRACE", None)
        watcher = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvdoctor.cli",
                "watch",
                str(child.pid),
                "--interval",
                "0.2",
                "--duration",
                "6",
                "--prometheus",
                f"127.0.0.1:{port}",
                "--format",
                "json",
                "--trace",
                str(tmp_path / "w.kvtrace.json"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
        )
        scrapes: list[str] = []
        deadline = time.monotonic() + 15
        while watcher.poll() is None and time.monotonic() < deadline and len(scrapes) < 4:
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    assert resp.status == 200
                    assert resp.headers["Content-Type"].startswith("text/plain")
                    body = resp.read().decode()
                if "kvdoctor:memory_bytes" in body:
                    scrapes.append(body)
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.7)
        assert len(scrapes) >= 2, "no metrics scraped while the watch ran"
        rss = []
        for body in scrapes:
            memory = _families(body)["kvdoctor:memory_bytes"]
            mine = [s for s in memory.samples if s.labels["pid"] == str(child.pid)]
            assert {"rss", "anon"} <= {s.labels["class"] for s in mine}
            assert all(s.labels["title"] for s in mine)
            rss.append(next(s.value for s in mine if s.labels["class"] == "rss"))
        assert rss[-1] > rss[0]  # the child allocates: the gauge follows it
        out, err = watcher.communicate(timeout=30)
        assert watcher.returncode in (0, 1), err
        assert f"Prometheus metrics on {url}" in err
        # the server stopped with the watch
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(url, timeout=2)
    finally:
        for proc in (watcher, child):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def test_watch_refuses_a_public_address_in_one_line():
    proc = _cli("watch", str(os.getpid()), "--duration", "1", "--prometheus", "0.0.0.0:0", "--format", "json")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--prometheus-public" in lines[0]
