"""The probe's two ways in at start-up (run's sitecustomize, the installed .pth hook) start it as an
engine's first module runs, never inside the import system's finder call.

Python calls a meta-path finder holding its global import lock. The probe once imported itself
there: a thread of the host importing a module at that moment (a sitecustomize's telemetry thread,
here one importing `json`) held that module's lock and waited for the global one, while the probe
waited for the module: the server hung before it served (seen on the GPU machine's Python 3.12,
every start; on 3.11 about one start in three).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO

PYTHONPATH_DIR = os.path.join(REPO, "kvdoctor", "delivery", "pythonpath")

# What each case runs: find the engine as the import system would, load it by hand, and say what
# was imported inside find_spec and whether the probe was on before the engine's body ran.
PROGRAM = textwrap.dedent(
    """
    import importlib.util, json, sys
    watch = next(f for f in sys.meta_path if getattr(f, "__name__", "") in ("_EngineWatch", "EngineWatch"))
    before = set(sys.modules)
    spec = watch.find_spec("sglang")
    during = sorted(m for m in set(sys.modules) - before if m.startswith("kvdoctor"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["sglang"] = module
    spec.loader.exec_module(module)
    print(json.dumps({
        "imported_in_find_spec": during,
        "probe_on_before_engine_ran": module.PROBE_ON,
        "loader_kept": type(module.__loader__).__name__,
        "spec_loader_kept": type(module.__spec__.loader).__name__,
    }))
    """
)


@pytest.fixture()
def fake_engine(tmp_path):
    root = tmp_path / "engine"
    (root / "sglang").mkdir(parents=True)
    (root / "sglang" / "__init__.py").write_text(
        "import sys\nPROBE_ON = getattr(sys.modules.get('kvdoctor.probe.core.hooks'), 'CURRENT', None) is not None "
        "and sys.modules['kvdoctor.probe.core.hooks'].CURRENT.probe is not None\n"
    )
    (root / "sglang" / "launch_server.py").write_text("import time\ntime.sleep(0.3)\n")
    return root


def _env(tmp_path, pythonpath: list[str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVDOCTOR_")}
    env.update(
        PYTHONPATH=os.pathsep.join(pythonpath),
        KVDOCTOR_AUTOPROBE="1",
        KVDOCTOR_TRACE=str(tmp_path / "t.kvtrace.json"),
        KVDOCTOR_PACKAGE_ROOT=REPO,
    )
    return env


@pytest.mark.parametrize("way_in", ["sitecustomize", "pth-hook"])
def test_the_probe_starts_as_the_engine_runs_not_inside_find_spec(tmp_path, fake_engine, way_in):
    if way_in == "sitecustomize":
        path, program = [PYTHONPATH_DIR, str(fake_engine)], PROGRAM
    else:  # what kvdoctor-autoprobe.pth does where kvdoctor is installed
        path, program = [str(fake_engine), REPO], "import kvdoctor.probe.core.entry\n" + PROGRAM
    run = subprocess.run([sys.executable, "-c", program], env=_env(tmp_path, path), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert not [m for m in seen["imported_in_find_spec"] if m.startswith("kvdoctor.probe.core.runtime")], seen
    assert seen["probe_on_before_engine_ran"] is True, seen
    assert seen["loader_kept"] == seen["spec_loader_kept"] == "SourceFileLoader", seen


def test_a_host_thread_importing_at_start_up_never_hangs_the_server(tmp_path, fake_engine):
    """The hang itself: a sitecustomize after run's (run hands over to it) starts a thread that
    imports `json` as the engine is imported. Eight starts, each must end with the probe on."""
    chained = tmp_path / "host-site"
    chained.mkdir()
    (chained / "sitecustomize.py").write_text(
        "import threading\n\ndef _telemetry():\n    import json, csv, decimal, fractions, statistics  # noqa\n\n"
        "threading.Thread(target=_telemetry, daemon=True).start()\n"
    )
    program = "import sys, sglang.launch_server\nprint(sys.modules['sglang'].PROBE_ON)\n"
    env = _env(tmp_path, [PYTHONPATH_DIR, str(fake_engine), str(chained)])
    for start in range(8):
        try:
            run = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"start {start + 1} of 8 hung at the engine's import")
        assert run.returncode == 0 and run.stdout.strip() == "True", (start, run.stdout, run.stderr[-2000:])


def test_both_ways_in_hold_the_same_watch():
    """The sitecustomize cannot import the start-up hook (a process that never imports an engine
    loads nothing of kvdoctor), so each holds the watch: the same lines, kept alike here."""

    def watch_of(path: str) -> str:
        source = open(path).read()
        start = source.index("class _ProbeFirst:")
        tail = "        _activate()\n        return None\n"
        end = source.index(tail, source.index("def find_spec", start)) + len(tail)
        return source[start:end].replace("class _EngineWatch:", "class EngineWatch:")

    ours = watch_of(os.path.join(PYTHONPATH_DIR, "sitecustomize.py"))
    hooks = watch_of(os.path.join(REPO, "kvdoctor", "probe", "core", "entry.py"))
    assert ours == hooks
