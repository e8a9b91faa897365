"""Every CLI input fuzzed in-process (typer's runner): random arguments to replay, gate, watch,
demo and run, random budget strings, random pids. Each must end in exit 0/1/2 with at most one
'kvdoctor:' line of error, never a traceback, never a hang."""

import os
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvdoctor.cli import app
from kvdoctor.errors import KvdoctorError
from kvdoctor.units import parse_rate, parse_size

EXAMPLES = int(os.environ.get("KVDOCTOR_FUZZ_EXAMPLES", "2500"))
# An input that takes this long is a hang, not a slow machine: a loaded 2-core machine took
# 3.2 s on one input that takes 86 ms alone, so the limit is far from any honest input's time.
HANG_MS = 60_000
RUNNER = CliRunner()
TMP = tempfile.mkdtemp()
TOTAL = {"inputs": 0}

words = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=24)


def invoke(args):
    TOTAL["inputs"] += 1
    result = RUNNER.invoke(app, args, catch_exceptions=True)
    assert result.exit_code in (0, 1, 2), (args, result.exit_code, result.output)
    assert "Traceback" not in result.output, (args, result.output)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"{args}: {type(result.exception).__name__}: {result.exception}")
    return result


@settings(max_examples=EXAMPLES, deadline=HANG_MS, suppress_health_check=list(HealthCheck))
@given(content=st.binary(max_size=300), fmt=st.sampled_from(["text", "json", "html", "bogus", ""]))
def test_replay_any_file_any_format(content, fmt):
    path = os.path.join(TMP, "in.kvtrace.json")
    with open(path, "wb") as fh:
        fh.write(content)
    invoke(["replay", path, "--format", fmt])


@settings(max_examples=EXAMPLES, deadline=HANG_MS, suppress_health_check=list(HealthCheck))
@given(growth=words, orphans=st.one_of(st.integers(-(10**20), 10**20).map(str), words), fail_on=words)
def test_gate_any_budget(growth, orphans, fail_on):
    path = os.path.join(TMP, "gate.kvtrace.json")
    with open(path, "wb") as fh:
        fh.write(b'[\n{"ph":"M","name":"kvdoctor_header","pid":1,"args":{"schema":"kvdoctor.trace/1","engine":"sglang"}},\n')
    invoke(["gate", "--max-growth", growth, "--max-orphan-slots", orphans, "--fail-on", fail_on, path])


@settings(max_examples=EXAMPLES, deadline=HANG_MS, suppress_health_check=list(HealthCheck))
@given(
    pid=st.one_of(st.integers(-(10**12), 10**12).map(str), words),
    interval=st.one_of(st.floats(allow_nan=True).map(str), words),
    fmt=st.sampled_from(["auto", "jsonl", "text", "json", "yaml"]),
)
def test_watch_any_pid_and_interval(pid, interval, fmt):
    digits = pid.strip()
    if digits.isascii() and digits.isdigit() and 0 < int(digits) < 1 << 22 and os.path.exists(f"/proc/{int(digits)}"):
        return  # a real process: watching it is not hostile input
    invoke(["watch", pid, "--interval", interval, "--duration", "0.01", "--format", fmt, "--trace", os.path.join(TMP, "w.kvtrace.json")])


@settings(max_examples=EXAMPLES, deadline=HANG_MS, suppress_health_check=list(HealthCheck))
@given(text=words)
def test_sizes_and_rates_parse_or_refuse(text):
    TOTAL["inputs"] += 2
    for parse in (parse_size, parse_rate):
        try:
            value = parse(text)
        except KvdoctorError as exc:
            assert exc.message and "\n" not in exc.message
        else:
            assert value >= 0


@settings(max_examples=max(50, EXAMPLES // 50), deadline=HANG_MS, suppress_health_check=list(HealthCheck))
@given(fault=words, page=st.one_of(st.integers(-5, 5).map(str), words), fix=words)
def test_demo_and_run_refuse_bad_options(fault, page, fix):
    if fault in ("none", "leak", "double-free", "stale-last-loc", "relocate", "index-out-of-range", "double-alloc"):
        return  # a valid fault runs the whole demo: not hostile input
    invoke(["demo", "--fault", fault, "--page-size", page])
    invoke(["run", "--fix", fix or "x", "--", "/nonexistent/command"])


def test_inputs_fuzzed():
    assert TOTAL["inputs"] >= 4 * EXAMPLES
