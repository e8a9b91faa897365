"""The native path is optional, and the pure-Python path costs several times more per hooked
call: which one runs is never silent. `kvdoctor probes`, the first line `kvdoctor run` prints and
every probed process's trace header name it, and for the Python path why: KVDOCTOR_NATIVE=0, never
built, its build failed (setup.py's real build, with a compiler that fails), built for another
Python. The package is copied where its build is changed, so the checkout's own stays as it is."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, trace_events

from kvdoctor.probe import native
from kvdoctor.trace import schema

WORKLOAD = (
    "from kvdoctor.demo.workload import WorkloadConfig, run_workload; "
    "run_workload(WorkloadConfig(page_size=1, conversations=2, turns=1, pool_tokens=512))"
)


LINE = "from kvdoctor.runner.support import native_path_line; print(native_path_line())"  # what `kvdoctor probes` prints


def _env(root: str, env_extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KVDOCTOR_NATIVE", "KVDOCTOR_HOTPATH", "KVDOCTOR_TRACE")}
    env["PYTHONPATH"] = root
    env.update(env_extra or {})
    return env


def _kvdoctor(args: list[str], *, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "kvdoctor", *args]
    return subprocess.run(command, capture_output=True, text=True, env=_env(REPO, env_extra), cwd=REPO, timeout=300)


def _native_path_of(root, env_extra: dict[str, str] | None = None) -> str:
    """The native path line of the package at `root`, from a fresh interpreter."""
    env = _env(str(root), env_extra)
    proc = subprocess.run([sys.executable, "-c", LINE], capture_output=True, text=True, env=env, cwd=root, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


@pytest.fixture
def unbuilt_copy(tmp_path):
    """The package, its maps and setup.py copied without any build of the extension."""
    root = tmp_path / "copy"
    ignore = shutil.ignore_patterns("__pycache__", "_native*.so", "_native.build-error")
    shutil.copytree(os.path.join(REPO, "kvdoctor"), root / "kvdoctor", ignore=ignore)
    shutil.copytree(os.path.join(REPO, "probes"), root / "probes")
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, name), root / name)
    return root


def test_probes_says_the_python_path_runs_because_kvdoctor_native_is_0():
    proc = _kvdoctor(["probes"], env_extra={"KVDOCTOR_NATIVE": "0"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[:2] == ["installed here:", "  native path: pure Python: KVDOCTOR_NATIVE=0 is set"]


def test_the_old_name_kvdoctor_hotpath_still_works_and_the_new_one_wins():
    """KVDOCTOR_HOTPATH, the variable's name before, is read where KVDOCTOR_NATIVE is not set."""
    assert _native_path_of(REPO, {"KVDOCTOR_HOTPATH": "0"}) == "pure Python: KVDOCTOR_HOTPATH=0 is set"
    assert _native_path_of(REPO, {"KVDOCTOR_HOTPATH": "1", "KVDOCTOR_NATIVE": "off"}) == "pure Python: KVDOCTOR_NATIVE=off is set"


@pytest.mark.skipif(not native.active(), reason="the native path is not built here")
def test_the_compiled_build_in_use_is_named():
    from kvdoctor.runner.support import native_path_line

    line = native_path_line()
    assert line.startswith("compiled (kvdoctor/probe/native/_native.") and line.endswith(".so)"), line


def test_an_extension_never_built_or_built_for_another_python_is_said(unbuilt_copy):
    line = _native_path_of(unbuilt_copy)
    assert line.startswith("pure Python: the native path is not built here"), line
    (unbuilt_copy / "kvdoctor" / "probe" / "native" / "_native.cpython-39-x86_64-linux-gnu.so").write_bytes(b"")
    assert "built for another Python (_native.cpython-39-x86_64-linux-gnu.so)" in _native_path_of(unbuilt_copy)


def test_a_failed_build_is_kept_and_named(unbuilt_copy):
    """setup.py's own build, in place, with a compiler that fails: the install goes on without the
    extension (optional), and the probe says the build failed, and how."""
    build = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
        cwd=unbuilt_copy,
        env=dict(os.environ, CC="false"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-2000:]  # optional: the package installs without it
    line = _native_path_of(unbuilt_copy)
    assert line.startswith(
        "pure Python: the native path failed to build when kvdoctor was installed (false exited with status 1 on kvdoctor/probe/native/csrc/"
    ), line


def test_run_says_the_path_first_and_the_trace_header_records_it(tmp_path):
    trace = str(tmp_path / "python.kvtrace.json")
    command = ["run", "--sample-interval", "0", "--trace", trace, "--", sys.executable, "-c", WORKLOAD]
    proc = _kvdoctor(command, env_extra={"KVDOCTOR_NATIVE": "0"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.splitlines()[0] == "kvdoctor: native path pure Python: KVDOCTOR_NATIVE=0 is set"
    (header,) = [e["args"] for e in trace_events(trace, schema.HEADER) if e["args"].get("probe") == "kvdoctor"]
    assert header["native_path"] == "python" and header["native_path_reason"] == "KVDOCTOR_NATIVE=0 is set"


@pytest.mark.skipif(not native.active(), reason="the native path is not built here")
def test_a_probed_process_on_the_compiled_path_records_its_build(tmp_path):
    from kvdoctor.demo.workload import WorkloadConfig, run_workload
    from kvdoctor.probe.core import runtime

    trace = str(tmp_path / "compiled.kvtrace.json")
    runtime.activate(trace)
    try:
        run_workload(WorkloadConfig(page_size=1, conversations=2, turns=1, pool_tokens=512))
    finally:
        runtime.deactivate()
    (header,) = [e["args"] for e in trace_events(trace, schema.HEADER)]
    assert header["native_path"] == "compiled" and header["native_path_reason"] == native.CHOICE.reason
    assert "_native." in header["native_path_reason"]
