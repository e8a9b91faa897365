"""kvdoctor installed as a user installs it: a wheel built from this tree, put into a fresh venv
with no torch and no SGLang (kvdoctor's own environment), and into a server's environment.

In its own environment `--help` and `probes` work and `demo` says in one line what it needs. Its
`kvdoctor run` aims at the test suite's SGLang server Python (another environment) and names a
leak planted there exactly. A gate over a CI script that sets its own PYTHONPATH probes the
script's Python where kvdoctor is installed in that Python's environment (the wheel's start-up
hook, kvdoctor-autoprobe.pth), and where it is not, the verdict names the cause in one line.

The server's environments are venvs with no packages of their own that reach .venv's
site-packages through a path file: SGLang and torch from there, nothing of kvdoctor (a path file
does not run .venv's own path files, so its editable install of this checkout stays out).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import types

import pytest
from conftest import REPO, SUPPORT

sys.path.insert(0, SUPPORT)

import sglang_server

pytestmark = pytest.mark.slow

VENV_PYTHON = os.path.join(REPO, ".venv", "bin", "python")
SITE = os.path.relpath(sysconfig.get_paths()["purelib"], sys.prefix)  # lib/python3.X/site-packages
QUIET_PIP = ["-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile"]

BENCH_SH = """#!/bin/sh
# a CI job's benchmark: it sets its own PYTHONPATH, as such scripts often do
export PYTHONPATH="$(dirname "$0")"
"$SERVER_PYTHON" "$(dirname "$0")/bench.py"
"""
BENCH_PY = '''"""SGLang's real KV allocator: eight requests' slots taken, seven given back.
It ends once kvdoctor's sampler has seen it run this file (the sampler's counters name it)."""

import json
import os
import time

import torch
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

pool = TokenToKVPoolAllocator(1024, dtype=torch.float16, device="cpu", kvcache=None, need_sort=False)
held = [pool.alloc(16) for _ in range(8)]
for slots in held[:-1]:
    pool.free(slots)


def seen():
    with open(os.environ["KVDOCTOR_TRACE"]) as fh:
        for line in fh:
            if line.startswith("{") and str(os.getpid()) in line:
                event = json.loads(line.rstrip().rstrip(","))
                if event.get("pid") == os.getpid() and "bench.py" in str(event.get("args", {}).get("title", "")):
                    return True
    return False


deadline = time.monotonic() + 120
while not seen() and time.monotonic() < deadline:
    time.sleep(0.1)
'''


def _run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    kwargs.setdefault("timeout", 600)
    return subprocess.run(args, capture_output=True, text=True, **kwargs)


def _sglang_env(path: str) -> str:
    """A venv whose packages are .venv's (SGLang, torch), without kvdoctor; its Python."""
    _run([VENV_PYTHON, "-m", "venv", "--without-pip", path], check=True)
    with open(os.path.join(path, SITE, "zz-sglang-packages.pth"), "w") as fh:
        fh.write(os.path.join(REPO, ".venv", SITE) + "\n")
    return os.path.join(path, "bin", "python")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The wheel built from a copy of this tree, and three environments: kvdoctor's own (the wheel
    and its dependencies, no torch, no SGLang), a server's with kvdoctor installed, one without."""
    root = tmp_path_factory.mktemp("install")
    source = root / "source"  # a copy: the build's own folder never meets another build of the checkout
    source.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, name), source / name)
    shutil.copytree(os.path.join(REPO, "probes"), source / "probes")
    shutil.copytree(os.path.join(REPO, "kvdoctor"), source / "kvdoctor", ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.build-*"))
    built = _run([VENV_PYTHON, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(root / "dist"), str(source)])
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = [str(root / "dist" / n) for n in os.listdir(root / "dist") if n.endswith(".whl")]
    tool = root / "kvdoctor-env"
    _run([VENV_PYTHON, "-m", "venv", str(tool)], check=True)
    pip = _run([str(tool / "bin" / "python"), *QUIET_PIP, wheel])
    assert pip.returncode == 0, pip.stderr[-3000:]
    with_kvdoctor = _sglang_env(str(root / "server-env"))
    pip = _run([VENV_PYTHON, "-m", "pip", "--python", with_kvdoctor, "install", "-q", "--disable-pip-version-check", "--no-deps", wheel])
    assert pip.returncode == 0, pip.stderr[-3000:]
    return types.SimpleNamespace(
        wheel=wheel,
        tool=str(tool),
        kvdoctor=str(tool / "bin" / "kvdoctor"),
        python=str(tool / "bin" / "python"),
        with_kvdoctor=with_kvdoctor,
        without_kvdoctor=_sglang_env(str(root / "bare-server-env")),
    )


def _tool_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVDOCTOR_", "PYTHON"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(os.path.join(REPO, ".venv")))
    return env


def test_the_wheel_alone_answers_help_and_probes_and_says_in_one_line_what_the_demo_needs(installed, tmp_path):
    env = _tool_env()
    missing = _run([installed.python, "-c", "import importlib.util as u; print(u.find_spec('torch'), u.find_spec('sglang'))"], env=env)
    assert missing.stdout.split() == ["None", "None"], missing  # a fresh environment: no torch, no SGLang
    for args in (["--help"], ["probes"]):
        proc = _run([installed.kvdoctor, *args], env=env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert "native path: compiled" in proc.stdout  # built at install: a compiler is present here
    demo = _run([installed.kvdoctor, "demo"], env=env, cwd=tmp_path)
    assert demo.returncode == 2 and demo.stdout == "", demo
    (line,) = demo.stderr.splitlines()
    assert line.startswith("kvdoctor: the demo needs torch and SGLang") and "has neither" in line, line
    assert "Traceback" not in line and "internal error" not in line and "pip install" in line
    assert not os.listdir(tmp_path)  # refused before any trace was started


def test_the_start_up_hook_costs_nothing_unless_run_asks_for_it(installed):
    """The wheel's .pth imports nothing of kvdoctor in a Python kvdoctor did not start; under
    `run` (KVDOCTOR_AUTOPROBE set) it loads only its few lines, the probe waiting for an engine."""
    code = "import sys; print(sorted(m for m in sys.modules if m.startswith('kvdoctor')))"
    assert _run([installed.python, "-c", code], env=_tool_env()).stdout.strip() == "[]"
    asked = _run([installed.python, "-c", code], env={**_tool_env(), "KVDOCTOR_AUTOPROBE": "1"})
    assert (
        asked.stdout.strip() == "['kvdoctor', 'kvdoctor.probe', 'kvdoctor.probe.core', 'kvdoctor.probe.core.entry']" and asked.stderr == ""
    ), asked
    # where both ways in meet (kvdoctor installed, PYTHONPATH kept), one watch waits for the engine
    inject = _run([installed.with_kvdoctor, "-c", "import kvdoctor, os; print(os.path.dirname(kvdoctor.__file__))"]).stdout.strip()
    watches = "import sys; print([f.__name__ for f in sys.meta_path if 'Watch' in getattr(f, '__name__', '')])"
    both = {**_tool_env(), "KVDOCTOR_AUTOPROBE": "1", "PYTHONPATH": os.path.join(inject, "delivery", "pythonpath")}
    assert _run([installed.with_kvdoctor, "-c", watches], env=both).stdout.strip() == "['EngineWatch']"
    sources = [
        open(os.path.join(REPO, "kvdoctor", *p)).read()
        for p in (("delivery", "pythonpath", "sitecustomize.py"), ("probe", "core", "entry.py"))
    ]
    for name in ("ENGINE_PACKAGES = ", "_OFF = "):  # both ways in watch for the same engines, read attribution alike
        assert len({s.split(name, 1)[1].split("#", 1)[0].strip() for s in sources}) == 1, name


def _gate_over_a_script(installed, tmp_path, server_python: str) -> subprocess.CompletedProcess:
    (tmp_path / "bench.sh").write_text(BENCH_SH)
    (tmp_path / "bench.sh").chmod(0o755)
    (tmp_path / "bench.py").write_text(BENCH_PY)
    env = {**_tool_env(), "SERVER_PYTHON": server_python}
    return _run([installed.kvdoctor, "gate", "--trace", str(tmp_path / "t.kvtrace.json"), "--", "./bench.sh"], env=env, cwd=tmp_path)


def test_a_gate_over_a_script_that_sets_its_own_pythonpath_probes_where_kvdoctor_is_installed(installed, tmp_path):
    gate = _gate_over_a_script(installed, tmp_path, installed.with_kvdoctor)
    assert gate.returncode == 1, gate.stdout + gate.stderr[-2000:]
    lines = {line.split(":", 1)[0].strip(): line for line in gate.stdout.splitlines() if line.startswith("  ")}
    assert lines["PASS  probe-reported"].endswith("(sglang: pid " + lines["PASS  probe-reported"].rsplit(" ", 1)[1]), lines
    assert "FAIL  max-orphan-slots: 16 orphaned KV slot(s)" in gate.stdout, gate.stdout  # the request left holding its 16 slots


def test_a_gate_over_a_script_that_sets_its_own_pythonpath_says_why_where_kvdoctor_is_not_installed(installed, tmp_path):
    gate = _gate_over_a_script(installed, tmp_path, installed.without_kvdoctor)
    assert gate.returncode == 1, gate.stdout + gate.stderr[-2000:]
    (line,) = [line for line in gate.stdout.splitlines() if "probe-reported" in line]
    assert line.startswith("  FAIL  probe-reported: no probe reported from an engine: pid "), line
    assert "(python ./bench.py): the process's PYTHONPATH lost kvdoctor's directory: keep $PYTHONPATH in it" in line, line


class _ServedFromAnotherEnvironment(sglang_server.Server):
    """The suite's server, its Python .venv's, under the `kvdoctor run` of kvdoctor's own venv; the
    server's PYTHONPATH has the planted faults and the sgl_kernel stand-in, not this checkout."""

    def __init__(self, workdir: str, kvdoctor: str, **kwargs) -> None:
        env = {**_tool_env(), "PYTHONPATH": os.pathsep.join([sglang_server.FAULT_DIR, SUPPORT])}
        super().__init__(workdir, probe=False, env=env, **kwargs)
        self.kvdoctor = kvdoctor

    def command(self) -> list[str]:
        return [self.kvdoctor, "run", "--trace", self.trace, "--", *super().command()]


@pytest.mark.usefixtures("needs_sglang_server")
def test_run_from_kvdoctors_own_environment_names_a_leak_planted_in_the_servers(installed, tmp_path):
    server = _ServedFromAnotherEnvironment(str(tmp_path), installed.kvdoctor, flags=["--disable-radix-cache"], fault="leak", fault_at=3)
    try:
        server.start()
        chats = server.conversations(turns=2, users=4, abort_every=0)
        assert chats["ok"] >= 6 and chats["errors"] == 0, chats
    finally:
        server.stop()
    planted = (server.fault() or {}).get("leak")
    assert planted, server.log_tail()
    replay = _run([installed.kvdoctor, "replay", server.trace, "--format", "json"], env=_tool_env(), cwd=tmp_path)
    report = json.loads(replay.stdout)
    orphans = [f for f in report["findings"] if f["kind"] == "orphan_slots"]
    assert replay.returncode == 1 and [f["count"] for f in orphans] == [planted["count"]], report["findings"][:3]
    assert orphans[0]["evidence"]["slot_ids"] == planted["slot_ids"][: len(orphans[0]["evidence"]["slot_ids"])]
    probed = {str(info.get("engine")) for info in report["processes"].values() if info.get("probe")}
    assert probed == {"sglang"}, report["processes"]
