"""A run whose engine the sampler named but whose probe never reported must not read as a clean one.

Seen on the H200 (issue #47): `kvdoctor run` of a whole SGLang 0.5.23 server whose probe could not come
up in any of its processes printed "no findings", as a run the probe had watched and found clean would.
The trace held only the sampler's records of the server's processes (their engine guessed from the
command line) and no probe event at all."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

from kvdoctor.trace import schema
from kvdoctor.trace.writer import TraceWriter, finish_trace


def _sampled_only(path: str) -> str:
    """What that run's trace held: the sampler's headers and memory samples, nothing from a probe."""
    writer = TraceWriter(path)
    title = "python3 -m sglang.launch_server --model-path /m --port 30000"
    batch = [
        schema.header_event(
            pid=700, engine="sglang", engine_version="", process_title=title, extra={"source": "sampler", "role": "python"}
        ),
        schema.header_event(pid=761, engine="", engine_version="", process_title="sglang::scheduler", extra={"source": "sampler"}),
    ]
    batch += [schema.Event(ph="C", name="memory", pid=700, ts=1e6 * (1 + i), args={"rss_bytes": 10**9}) for i in range(3)]
    writer.write_batch(batch)
    writer.close()
    finish_trace(path, 700)
    return path


def test_replay_says_nothing_was_checked_when_no_probe_reported(tmp_path):
    path = _sampled_only(str(tmp_path / "t.kvtrace.json"))
    proc = subprocess.run([sys.executable, "-m", "kvdoctor.cli", "replay", path], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    verdict = [line for line in proc.stdout.splitlines() if line.startswith("no findings")]
    assert verdict == ["no findings, but no probe reported from the sglang process(es): nothing was checked"], proc.stdout
