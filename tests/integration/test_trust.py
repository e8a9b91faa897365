"""A verdict people can trust, and no harm outside the server: the cases a hostile user found.

Each test is one way kvdoctor used to give a false green, destroy a file, leak a secret, print a
client's control bytes raw, end in "internal error", or leave a process behind.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest
from conftest import REPO

from kvdoctor.delivery.launch import FORWARDED_SIGNALS
from kvdoctor.trace import schema
from kvdoctor.trace.writer import TraceWriter, finish_trace

LEAK = "from kvdoctor.demo.workload import WorkloadConfig, run_workload; run_workload(WorkloadConfig(fault='leak', turns=2))"


def kv(*args: str, cwd=None, timeout: float = 300, input_text: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvdoctor.cli", *args], capture_output=True, text=True, cwd=cwd or REPO, timeout=timeout, input=input_text
    )


def one_line_error(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == code and len(lines) == 1 and lines[0].startswith("kvdoctor: "), (proc.returncode, proc.stderr[-2000:])
    assert "internal error" not in proc.stderr and "Traceback" not in proc.stderr
    return lines[0]


def trace_with(path, events, *, engine="sglang", census=True) -> str:
    """A trace as the probe writes one: its header, then `events`, then (optionally) a clean census."""
    writer = TraceWriter(str(path))
    batch = [
        schema.header_event(pid=7, engine=engine, engine_version="0.5.23", process_title="sglang::scheduler", extra={"probe": "kvdoctor"})
    ]
    batch += events
    if census:
        batch.append(
            schema.Event(ph="i", name=schema.CENSUS, pid=7, ts=2e6, args={"allocator": "A#0", "reason": "exit", "orphan_slots": 0})
        )
    writer.write_batch(batch)
    writer.close()
    finish_trace(str(path), 7)
    return str(path)


def violation(kind: str, count: int, **extra) -> schema.Event:
    return schema.Event(ph="i", name=schema.VIOLATION, pid=7, ts=1e6, args={"kind": kind, "count": count, "allocator": "A#0", **extra})


# ---------------------------------------------------------------- 1-3, 8: the gate's verdict


def test_gate_fails_when_the_command_fails(tmp_path):
    proc = kv("gate", "--trace", str(tmp_path / "t.kvtrace.json"), "--", "bash", "-c", "sleep 1; exit 3", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout
    assert "FAIL  command-exit: the command exited 3" in proc.stdout and "kvdoctor gate: FAIL" in proc.stdout


def test_gate_fails_when_the_probe_never_loaded(tmp_path):
    """`python -E` ignores PYTHONPATH: the probe never loads, the planted leak goes unseen."""
    proc = kv("gate", "--trace", str(tmp_path / "t.kvtrace.json"), "--", sys.executable, "-E", "-c", LEAK, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    assert "FAIL  probe-reported: no probe reported from an engine" in proc.stdout


def test_gate_passes_a_probed_clean_run_and_names_the_judged_processes(tmp_path):
    clean = LEAK.replace("fault='leak'", "fault='none'")
    # a run of seconds is too short to judge growth on: the case is the slots' verdict
    proc = kv(
        "gate",
        "--engine",
        "sglang",
        "--max-growth",
        "off",
        "--trace",
        str(tmp_path / "t.kvtrace.json"),
        "--",
        sys.executable,
        "-c",
        clean,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout
    assert "PASS  probe-reported: judged the processes the probe reported from (sglang: pid" in proc.stdout


def test_gate_fails_on_any_error_finding_unless_waived_by_name(tmp_path):
    path = trace_with(tmp_path / "t.kvtrace.json", [violation("use_after_free", 8), violation("lock_ref_underflow", 1)])
    proc = kv("gate", path)
    assert proc.returncode == 1 and "FAIL  no-other-errors: error findings: lock_ref_underflow x1, use_after_free x8" in proc.stdout
    waived = kv("gate", "--allow", "use-after-free,lock_ref_underflow", "--max-growth", "off", path)  # no memory samples to judge
    assert waived.returncode == 0, waived.stdout


@pytest.mark.parametrize(
    "spelling,accepted", [("double-free", True), ("double_free", True), ("bogus_kind", False), ("", False), ("doble_free", False)]
)
def test_budget_names_are_checked(tmp_path, spelling, accepted):
    path = trace_with(tmp_path / "t.kvtrace.json", [])
    proc = kv("gate", "--fail-on", spelling, "--max-growth", "off", path)  # the trace has no memory samples
    if accepted:
        assert proc.returncode == 0 and "no-double_free" in proc.stdout
    else:
        line = one_line_error(proc)
        assert ("did you mean double_free?" in line) if spelling == "doble_free" else ("finding kind" in line)


def test_no_census_is_no_orphan_verdict(tmp_path):
    path = trace_with(tmp_path / "t.kvtrace.json", [], census=False)
    gate = kv("gate", path)
    assert gate.returncode == 2 and "N/A   max-orphan-slots: no census ran" in gate.stdout and "COULD NOT JUDGE" in gate.stdout
    replay = kv("replay", path)
    assert replay.returncode == 0 and "no census ran: no slot was counted" in replay.stdout
    assert "every slot is accounted for" not in replay.stdout


def test_a_baseline_from_another_engine_is_refused(tmp_path):
    mine = trace_with(tmp_path / "sglang.kvtrace.json", [])
    theirs = trace_with(tmp_path / "vllm.kvtrace.json", [], engine="vllm")
    assert "was probed from vllm, this run from sglang" in one_line_error(kv("gate", "--baseline", theirs, mine))


# ---------------------------------------------------------------- 4, 10: files and secrets


@pytest.mark.parametrize(
    "command",
    [
        ["run", "--trace", "{path}", "{force}", "--", "true"],
        ["demo", "--fault", "none", "--trace", "{path}", "{force}"],
        ["gate", "--trace", "{path}", "{force}", "--", "true"],
    ],
)
def test_no_command_replaces_a_file_it_did_not_create(tmp_path, command):
    def args(path: str, force: bool) -> list[str]:
        out = [a.replace("{path}", path) for a in command]
        return [a for a in out if a != "{force}"] if not force else [("--force" if a == "{force}" else a) for a in out]

    mine = tmp_path / "notes.txt"
    mine.write_text("my notes")
    assert "exists: kvdoctor will not replace it" in one_line_error(kv(*args(str(mine), False), cwd=tmp_path))
    assert mine.read_text() == "my notes"
    assert "not a regular file" in one_line_error(kv(*args("/dev/null", True), cwd=tmp_path))
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_force_replaces_and_reports_are_private(tmp_path, demo_leak_trace):
    report = tmp_path / "r.html"
    report.write_text("old")
    assert kv("replay", demo_leak_trace, "--format", "html", "-o", str(report)).returncode == 2
    assert kv("replay", demo_leak_trace, "--format", "html", "-o", str(report), "--force").returncode == 1
    assert "orphan_slots" in report.read_text() and stat.S_IMODE(os.stat(report).st_mode) == 0o600


def test_secrets_on_the_command_line_are_written_nowhere(tmp_path):
    trace = tmp_path / "t.kvtrace.json"
    secret = "sk-THISISASECRETKEY123456"
    proc = kv(
        "run",
        "--trace",
        str(trace),
        "--",
        sys.executable,
        "-c",
        LEAK,
        "--api-key",
        secret,
        "HF_TOKEN=hf_abcdefghijklmnopqrstuv",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    html = tmp_path / "r.html"
    kv("replay", str(trace), "--format", "html", "-o", str(html))
    for text in (trace.read_text(), html.read_text(), proc.stderr):
        assert secret not in text and "hf_abcdefghijklmnopqrstuv" not in text
    assert "--api-key ***" in trace.read_text()


# ---------------------------------------------------------------- 7, 13: crafted traces


@pytest.fixture(scope="module")
def demo_leak_trace(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("demo") / "leak.kvtrace.json")
    assert kv("demo", "--trace", path).returncode == 0
    return path


def test_control_bytes_from_a_client_never_reach_a_terminal_or_junit_raw(tmp_path):
    rid = "evil\x1b[2J\x1b]0;owned\x07\x00rid"
    path = trace_with(
        tmp_path / "t.kvtrace.json", [violation("double_free", 2, slot_ids=[1, 2], requests={f"req_pool_idx 3 (rid {rid})": 2})]
    )
    replay = kv("replay", path)
    junit = tmp_path / "j.xml"
    gate = kv("gate", "--junit", str(junit), path)
    for out in (replay.stdout, gate.stdout):
        assert "\x1b" not in out and "\x00" not in out and "\x07" not in out
    assert "evil\\x1b[2J" in replay.stdout
    assert gate.returncode == 1
    ET.parse(junit)  # well-formed XML


@pytest.mark.parametrize("title", [12345, {"a": 1}, "lone \ud800 surrogate"])
def test_crafted_titles_and_numbers_end_in_a_report_not_an_error(tmp_path, title):
    writer = TraceWriter(str(tmp_path / "t.kvtrace.json"))
    header = schema.header_event(pid=7, engine="sglang", engine_version="0.5.23", process_title="x")
    header.args["process_title"] = title
    memory = [
        schema.Event(ph="C", name=schema.MEMORY_COUNTER, pid=7, ts=i * 1e6, args={"anon_bytes": 1e308 if i % 2 else 1e9}) for i in range(40)
    ]
    writer.write_batch([header, *memory])
    writer.close()
    for fmt in ("text", "json", "html"):
        proc = kv("replay", str(tmp_path / "t.kvtrace.json"), "--format", fmt)
        assert proc.returncode in (0, 1) and "internal error" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-1500:]


def test_a_reader_that_goes_away_changes_nothing(demo_leak_trace):
    proc = subprocess.run(
        f"{sys.executable} -m kvdoctor.cli replay {demo_leak_trace} | head -1; exit ${{PIPESTATUS[0]}}",
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 1 and "BrokenPipe" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr


def test_an_unwritable_report_keeps_the_verdict(demo_leak_trace, tmp_path):
    proc = kv("gate", "--junit", "/proc/kvdoctor-no-such/j.xml", demo_leak_trace)
    assert proc.returncode == 1 and "kvdoctor gate: FAIL" in proc.stdout and "cannot write the JUnit report" in proc.stderr
    proc = kv("replay", demo_leak_trace, "-o", "/proc/kvdoctor-no-such/r.txt")
    assert proc.returncode == 1 and "cannot write" in proc.stderr


# ---------------------------------------------------------------- 9: bounded replay memory


def _peak_rss_of(args: list[str]) -> tuple[int, subprocess.CompletedProcess]:
    code = (
        "import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024); sys.stderr.write(p.stdout[-500:] + p.stderr[-1500:])"
    )
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600, cwd=REPO)
    return int(proc.stdout.strip().splitlines()[-1]), proc


def test_replay_memory_stays_bounded_on_a_giant_line_and_many_processes(tmp_path):
    path = tmp_path / "crafted.kvtrace.json"
    with open(path, "wb") as fh:
        fh.write(
            b"[\n"
            + json.dumps(schema.header_event(pid=1, engine="sglang", engine_version="0.5.23", process_title="x").to_json_dict()).encode()
            + b",\n"
        )
        fh.write(b'{"ph":"i","name":"violation","pid":1,"args":{"x":"' + b"A" * (40 << 20) + b'"}},\n')  # one 40 MiB line
        for pid in range(2, 20_002):  # 20,000 processes
            fh.write(
                b'{"ph":"M","name":"kvdoctor_header","pid":%d,"args":{"schema":"kvdoctor.trace/1","engine":"sglang","process_title":"p"}},\n'
                % pid
            )
    peak, proc = _peak_rss_of([sys.executable, "-m", "kvdoctor.cli", "replay", str(path)])
    assert "longer than 16 MiB were skipped" in proc.stderr and "more than 4096 processes" in proc.stderr, proc.stderr[-2000:]
    assert peak < 400 << 20, f"peak RSS {peak >> 20} MiB"


# ---------------------------------------------------------------- 11: no process left behind


def _session_pids(sid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    out.append(int(entry))
            except OSError:
                continue
    return out


def _run_started(tmp_path, script: str, ignoring: tuple[int, ...] = ()) -> subprocess.Popen:
    """`kvdoctor run -- sh -c SCRIPT`, returned once the script has touched `{marker}`; `run`
    starts with the signals `ignoring` ignored, as `nohup` starts it."""
    marker = tmp_path / "started"

    def ignore() -> None:  # whatever the suite was started with: only `ignoring` is ignored
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, signal.SIG_IGN if sig in ignoring else signal.SIG_DFL)

    with open(tmp_path / "run.stderr", "wb") as stderr:  # the child keeps its own copy; _wait_or_explain reads it
        run = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvdoctor.cli",
                "run",
                "--trace",
                str(tmp_path / "t.kvtrace.json"),
                "--",
                "sh",
                "-c",
                script.format(marker=marker),
            ],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            preexec_fn=ignore,
        )
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return run


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1])
def test_run_ends_the_whole_group_it_started(tmp_path, sig):
    run = _run_started(tmp_path, "sleep 300 & sleep 300 & touch {marker}; wait")
    children = [p for p in _session_pids(_child_sid(run.pid)) if p != run.pid]
    assert len(children) >= 3  # the shell and its two sleeps
    run.send_signal(sig)
    _wait_or_explain(run, children, tmp_path)
    deadline = time.monotonic() + 10  # the group's ending is signalled, not waited for: a busy machine takes a moment
    while any(_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in children if _alive(p)] == []


def test_a_signal_run_was_started_ignoring_stays_ignored_for_its_command(tmp_path):
    # nohup: the hang-up that ends the terminal must not reach the server through `run`
    run = _run_started(tmp_path, "touch {marker}; exec sleep 300", ignoring=(signal.SIGHUP,))
    (child,) = [p for p in _session_pids(_child_sid(run.pid)) if p != run.pid]
    assert _ignored_signals(child) & (1 << (signal.SIGHUP - 1))  # the command inherits the ignore
    run.send_signal(signal.SIGHUP)  # ignored by run: nothing is forwarded
    run.send_signal(signal.SIGTERM)  # forwarded: the command ends of this one, not of the hang-up
    assert _wait_or_explain(run, [child], tmp_path) == 128 + signal.SIGTERM


def _wait_or_explain(run: subprocess.Popen, children: list[int], tmp_path) -> int:
    """run's exit code; if it does not end, a failure that says where run and its command stand
    (state, kernel wait channel, signal masks, what run printed), and then they are killed."""
    try:
        return run.wait(timeout=60)
    except subprocess.TimeoutExpired:
        seen = "\n".join(_where(pid) for pid in [run.pid, *children])
        printed = (tmp_path / "run.stderr").read_bytes()[-2000:].decode(errors="replace")
        for pid in [run.pid, *children]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        run.wait()
        pytest.fail(f"run did not end within 60 s of its signal\n{seen}\nrun printed:\n{printed}")


def _where(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as fh:
            fields = [line.strip() for line in fh if line.startswith(("Name", "State", "SigBlk", "SigIgn", "SigCgt", "SigPnd", "ShdPnd"))]
        with open(f"/proc/{pid}/wchan") as fh:
            fields.append("wchan: " + fh.read())
        return f"pid {pid}: " + ", ".join(fields)
    except OSError:
        return f"pid {pid}: gone"


def _ignored_signals(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1], 16) for line in fh if line.startswith("SigIgn:"))


def test_killing_run_itself_takes_its_command_down(tmp_path):
    run = _run_started(tmp_path, "touch {marker}; exec sleep 300")
    (child,) = [p for p in _session_pids(_child_sid(run.pid)) if p != run.pid]
    run.kill()
    run.wait(timeout=30)
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def _child_sid(run_pid: int) -> int:
    with open(f"/proc/{run_pid}/task/{run_pid}/children") as fh:
        return os.getsid(int(fh.read().split()[0]))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ---------------------------------------------------------------- 12, 14: numbers and small things


@pytest.mark.parametrize(
    "args,says",
    [
        (["run", "--sample-interval", "-5", "--", "true"], "--sample-interval must be 0"),
        (["run", "--sample-interval", "nan", "--", "true"], "--sample-interval must be 0"),
        (["demo", "--page-size", "0"], "--page-size must be 1 or more"),
        (["demo", "--page-size", "-4"], "--page-size must be 1 or more"),
        (["watch", "--interval", "inf", "1"], "--interval must be a positive number"),
        (["gate", "--max-growth", "1e300GiB/h", "--", "true"], "is beyond any machine's memory"),
        (["watch", "2", "--duration", "1"], "is a kernel thread"),
    ],
)
def test_bad_numbers_and_targets_get_one_line(args, says, tmp_path):
    assert says in one_line_error(kv(*args, cwd=tmp_path))


def test_per_millisecond_is_per_millisecond():
    from kvdoctor.units import parse_rate

    assert parse_rate("500MiB/ms") == 500 * 2**20 * 1000
    assert parse_rate("1GiB/hours") == 2**30 / 3600 and parse_rate("2MiB/mins") == 2 * 2**20 / 60


def test_attach_leaves_a_stopped_process_stopped(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        os.kill(sleeper.pid, signal.SIGSTOP)
        time.sleep(0.2)
        line = one_line_error(kv("attach", str(sleeper.pid), "--trace", str(tmp_path / "a.kvtrace.json")))
        assert "is stopped" in line
        with open(f"/proc/{sleeper.pid}/stat") as fh:
            assert fh.read().rsplit(")", 1)[1].split()[0] == "T"  # still stopped
    finally:
        sleeper.kill()
        sleeper.wait()
