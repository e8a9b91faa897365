"""The probe inside real processes: `kvdoctor run` into spawn children, fault containment at every
hook, an SGLang version we do not know, and the layering rule that probes import no analysis."""

import ast
import json
import os
import subprocess
import sys
import warnings

import pytest
from conftest import REPO, sglang_env

warnings.filterwarnings("ignore")

CHILD_SCRIPT = r"""
import multiprocessing as mp, sys, warnings
warnings.filterwarnings("ignore")

def scheduler(fault):
    from kvdoctor.demo.workload import WorkloadConfig, run_workload
    run_workload(WorkloadConfig(fault=fault))

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=scheduler, args=(sys.argv[1],), name="scheduler")
    p.start(); p.join()
    sys.exit(3 if p.exitcode == 0 else 9)
"""


def kvdoctor(*args, env=None, cwd=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "kvdoctor.cli", *args],
        capture_output=True,
        text=True,
        env=env or sglang_env("0.5.23"),
        cwd=cwd or REPO,
        timeout=timeout,
    )


@pytest.mark.parametrize("fault,errors", [("leak", 1), ("none", 0)])
def test_run_reaches_spawn_children(tmp_path, fault, errors):
    script = tmp_path / "server.py"
    script.write_text(CHILD_SCRIPT)
    trace = tmp_path / "run.kvtrace.json"
    proc = kvdoctor("run", "--trace", str(trace), "--format", "json", "--", sys.executable, str(script), fault, cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr[-2000:]  # CMD's own exit code
    with open(trace) as fh:
        doc = json.load(fh)  # a cleanly finished trace is strict JSON (and Trace Event Format)
    pids = {e["pid"] for e in doc if e.get("name") == "kvdoctor_header" and e["args"].get("source") != "sampler"}
    assert len(pids) == 1 and os.getpid() not in pids  # the probe spoke from the spawned child only
    sampled = {e["pid"] for e in doc if e.get("name") == "memory"}
    assert pids <= sampled  # and the sampler followed CMD's process tree down to that child
    replay = kvdoctor("replay", str(trace), "--format", "json")
    report = json.loads(replay.stdout)
    assert replay.returncode == (1 if errors else 0)
    kinds = [f["kind"] for f in report["findings"] if f["severity"] == "error"]
    assert kinds == (["orphan_slots"] if errors else [])
    if errors:
        leak = report["findings"][0]
        assert leak["count"] == 64 and leak["evidence"]["slot_ids"]


def _workload_once(fault="none"):
    from kvdoctor.demo.workload import WorkloadConfig, run_workload

    out = []
    for page_size in (1, 4):
        result = run_workload(WorkloadConfig(fault=fault, page_size=page_size, turns=3))
        out.append((result.outputs_digest, result.sglang_check, result.planted))
    return out


ROLES = [
    "alloc",
    "alloc_extend",
    "alloc_decode",
    "free",
    "free_segment",
    "tree_insert",
    "tree_evict",
    "tree_lock",
    "tree_unlock",
    "req_alloc",
    "req_free",
    "req_write",
    "clear",
]


def test_a_failing_hook_never_changes_the_host(tmp_path):
    from kvdoctor.analysis.analyzer import analyze
    from kvdoctor.probe.core import runtime
    from kvdoctor.trace.reader import iter_events

    baseline = {fault: _workload_once(fault) for fault in ("none", "leak")}
    survived = 0
    for role in ROLES:
        for fault in ("none", "leak"):
            path = str(tmp_path / f"{role}-{fault}.json")
            probe = runtime.activate(path)
            probe.inject = {role}
            outcome = _workload_once(fault)
            runtime.deactivate()
            assert outcome == baseline[fault], role
            analysis = analyze(iter_events(path))
            off = [f for f in analysis.findings if f.kind == "probe_off"]
            assert off and role in off[0].message, (role, [f.kind for f in analysis.findings])
            # findings made before the failure stay; nothing false is claimed after it
            if fault == "none":
                assert not analysis.errors
            else:
                assert all(f.kind == "orphan_slots" and f.count == 64 for f in analysis.errors)
            survived += 1
    assert survived == len(ROLES) * 2


LEDGER_WRITE_FAILS = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
from kvdoctor.demo.workload import WorkloadConfig, run_workload
from kvdoctor.probe import native
from kvdoctor.probe.core import runtime
from kvdoctor.probe.ledgers.slots import SlotLedger

def once():
    return [list(map(str, (r.outputs_digest, r.sglang_check, r.planted))) for r in (run_workload(WorkloadConfig(fault="leak", page_size=p, turns=3)) for p in (1, 4))]

baseline = once()

def broken(self, *a, **k):
    raise MemoryError("ledger out of memory")

SlotLedger.on_free = broken
runtime.activate(sys.argv[1])
assert native.NATIVE is None, "KVDOCTOR_NATIVE=0 keeps the Python path"
print("SAME" if once() == baseline else "CHANGED")
runtime.deactivate()
"""


def test_a_failing_ledger_write_turns_the_ledger_off(tmp_path):
    """On the Python path every free goes through `SlotLedger.on_free`; the native path records
    healthy frees itself (its own failures: tests/integration/test_native.py). A fresh
    interpreter with KVDOCTOR_NATIVE=0: methods another test hooked in this one stay compiled."""
    from kvdoctor.analysis.analyzer import analyze
    from kvdoctor.trace.reader import iter_events

    path = str(tmp_path / "t.json")
    env = sglang_env("0.5.23")
    env["KVDOCTOR_NATIVE"] = "0"
    proc = subprocess.run(
        [sys.executable, "-c", LEDGER_WRITE_FAILS, path], env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "SAME", proc.stderr[-3000:]
    analysis = analyze(iter_events(path))
    # a part of the probe that stopped for its cost on a busy machine is another matter
    assert [f.kind for f in analysis.findings if not f.evidence.get("for_cost")] == ["probe_off"]
    assert "MemoryError" in analysis.findings[0].message


WORKLOAD = "from kvdoctor.demo.workload import WorkloadConfig, run_workload; run_workload(WorkloadConfig(fault='leak', turns=3))"


@pytest.mark.parametrize("installed,expected_map,hooks", [("0.5.23", "sglang-0.5.23.toml", 80), ("0.5.9", "sglang-0.5.9.toml", 55)])
def test_a_release_without_a_tested_map_uses_the_nearest_map_that_resolves(tmp_path, installed, expected_map, hooks):
    """SGLang says it is 0.5.99 (no map is tested on it): the probe picks the map whose hooks all
    resolve in the installed sources, says so on stderr and in the trace, and finds the leak."""
    env = sglang_env(installed)
    env["KVDOCTOR_SGLANG_VERSION"] = "0.5.99"
    trace = tmp_path / "t.kvtrace.json"
    proc = kvdoctor("run", "--trace", str(trace), "--format", "json", "--", sys.executable, "-c", WORKLOAD, cwd=tmp_path, env=env)
    said = f"SGLang 0.5.99 has no tested map; using {expected_map}, all {hooks} hooks resolved"
    assert proc.returncode == 0 and said in proc.stderr, proc.stderr[-3000:]
    statuses = [e["args"]["reason"] for e in _events(trace) if e["name"] == "probe_status"]
    assert any(said in reason for reason in statuses)
    replay = kvdoctor("replay", str(trace), "--format", "json")
    errors = [f for f in json.loads(replay.stdout)["findings"] if f["severity"] == "error"]
    assert [f["kind"] for f in errors] == ["orphan_slots"]


def test_a_release_that_renamed_a_hooked_method_gets_the_nearest_map_that_resolves(tmp_path):
    """SGLang "0.5.99": 0.5.23's code with the paged allocator's own `merge_and_sort_free` renamed (a
    symlink copy of the installed package with one file edited), so the 0.5.23 map's hook on it
    does not resolve. The probe moves on to the nearest map whose every hook does (0.5.19's, from
    before Paged overrode the method), says so, and names the planted leak exactly, nothing else."""
    import sglang

    installed = os.path.dirname(sglang.__file__)
    fake = tmp_path / "site" / "sglang"
    (tmp_path / "site").mkdir()
    subprocess.run(["cp", "-rs", installed, str(fake)], check=True)
    paged = fake / "srt" / "mem_cache" / "allocator" / "paged.py"
    text = open(os.path.join(installed, "srt", "mem_cache", "allocator", "paged.py")).read()
    paged.unlink()
    paged.write_text(text.replace("merge_and_sort_free(", "merge_and_sort_pages("))
    env = sglang_env("0.5.23")
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), REPO])  # the fake release first, the checkout under test beside it
    env["KVDOCTOR_SGLANG_VERSION"] = "0.5.99"
    trace = tmp_path / "t.kvtrace.json"
    proc = kvdoctor("run", "--trace", str(trace), "--format", "json", "--", sys.executable, "-c", WORKLOAD, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SGLang 0.5.99 has no tested map; using sglang-0.5.19.toml, all 68 hooks resolved" in proc.stderr, proc.stderr[:3000]
    replay = kvdoctor("replay", str(trace), "--format", "json")
    errors = [(f["kind"], f["count"]) for f in json.loads(replay.stdout)["findings"] if f["severity"] == "error"]
    assert errors == [("orphan_slots", 64)]


def test_a_release_ci_cannot_run_is_named_with_the_reason(tmp_path):
    """0.5.1.post1 cannot be imported on the CI machine (probes/releases.toml says why): the probe
    still uses the map of its range and says, on stderr and in the trace, that CI did not test it
    and why. Its mem_cache is 0.5.2's but for one method, so 0.5.2's real code stands in for it."""
    env = sglang_env("0.5.2")
    env["KVDOCTOR_SGLANG_VERSION"] = "0.5.1.post1"
    trace = tmp_path / "t.kvtrace.json"
    proc = kvdoctor("run", "--trace", str(trace), "--format", "json", "--", sys.executable, "-c", WORKLOAD, cwd=tmp_path, env=env)
    said = (
        "SGLang 0.5.1.post1: map sglang-0.5.1.toml, not tested in CI: its sglang/srt/utils.py calls torch._C._cpu._is_amx_tile_supported()"
    )
    assert proc.returncode == 0 and said in proc.stderr, proc.stderr[-3000:]
    assert any(said in e["args"]["reason"] for e in _events(trace) if e["name"] == "probe_status")
    replay = kvdoctor("replay", str(trace), "--format", "json")
    assert [f["kind"] for f in json.loads(replay.stdout)["findings"] if f["severity"] == "error"] == ["orphan_slots"]


def _events(path):
    with open(path) as fh:
        return [json.loads(line.rstrip().rstrip(",")) for line in fh if line.startswith("{")]


ALLOWED_IN_PROBE = {"kvdoctor.trace.schema", "kvdoctor.trace.writer"}


def test_probe_imports_no_analysis():
    probe_dir = os.path.join(REPO, "kvdoctor", "probe")
    files = [os.path.join(d, f) for d, _, names in os.walk(probe_dir) for f in names if f.endswith(".py")]
    files.append(os.path.join(REPO, "kvdoctor", "delivery", "pythonpath", "sitecustomize.py"))
    for path in files:
        tree = ast.parse(open(path).read())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                packages = ("kvdoctor", "kvdoctor.trace")
                names = [f"{node.module}.{a.name}" for a in node.names] if node.module in packages else [node.module]
            for name in names:
                if name.startswith("kvdoctor") and not name.startswith("kvdoctor.probe"):
                    assert name in ALLOWED_IN_PROBE, f"{path} imports {name}"


INJECT_DIR = os.path.join(REPO, "kvdoctor", "delivery", "pythonpath")


def _under_run(code: str, tmp_path, extra_pythonpath: str = "") -> subprocess.CompletedProcess:
    """`python -c code` with the environment `kvdoctor run` gives its children."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (INJECT_DIR, extra_pythonpath) if p)
    env["KVDOCTOR_TRACE"] = str(tmp_path / "t.kvtrace.json")
    env["KVDOCTOR_PACKAGE_ROOT"] = REPO
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_a_process_without_an_engine_imports_nothing_of_kvdoctor(tmp_path):
    """The probe's start-up cost in the many processes that never import an engine is a few lines:
    no kvdoctor module (and so no numpy, no map parsing) is loaded, and no trace is written."""
    proc = _under_run(
        "import sys, json; print(json.dumps(sorted(m for m in sys.modules if m.startswith(('kvdoctor', 'numpy')))))", tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []
    assert proc.stderr == ""
    assert not (tmp_path / "t.kvtrace.json").exists()


def test_importing_an_engine_turns_the_probe_on_before_its_first_module(tmp_path):
    code = (
        "import sglang.srt.mem_cache.allocator.token as t; from kvdoctor.probe.core import runtime; "
        "print(runtime.current() is not None, hasattr(t.TokenToKVPoolAllocator.alloc, '__kvdoctor_role__'))"
    )
    proc = _under_run(code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", "True"]


def test_the_environments_own_sitecustomize_still_runs_and_nothing_is_printed(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_RAN'] = '1'\n")
    proc = _under_run("import os, sys; print(os.environ.get('THEIRS_RAN'), sys.modules['sitecustomize'].__file__)", tmp_path, str(theirs))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    ran, module_file = proc.stdout.split()
    assert ran == "1" and module_file == str(theirs / "sitecustomize.py")


def test_the_engines_watched_at_start_are_the_engines_with_maps():
    from kvdoctor.probe.maps.loader import available_maps

    source = open(os.path.join(INJECT_DIR, "sitecustomize.py")).read()
    watched = ast.literal_eval(source.split("ENGINE_PACKAGES = ", 1)[1].split("#", 1)[0].strip())
    assert set(watched) == {m.engine for m in available_maps()}


THEIR_IMPORT_HOOK = r"""
import importlib.abc, importlib.machinery, json, sys, warnings
warnings.filterwarnings("ignore")
import sglang  # the probe turns on here; the other package's hook goes in front of ours afterwards
TARGET = "sglang.srt.mem_cache.allocator.token"

class TheirLoader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner
    def create_module(self, spec):
        return self.inner.create_module(spec)
    def exec_module(self, module):
        self.inner.exec_module(module)
        module.LOADED_BY_THEM = True

class TheirFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        spec.loader = TheirLoader(spec.loader)
        return spec

sys.meta_path.insert(0, TheirFinder())
from kvdoctor.demo.workload import WorkloadConfig, run_workload
result = run_workload(WorkloadConfig(fault=sys.argv[1], turns=3))
assert sys.modules[TARGET].LOADED_BY_THEM
print("PLANTED " + json.dumps(result.planted))
"""


@pytest.mark.parametrize("fault", ["none", "leak"])
def test_another_import_hook_in_front_of_ours_costs_no_calls(tmp_path, fault):
    """Another package's import hook loads the allocator's module instead of ours: the probe still
    hooks it before it is used, so a clean run has no error and a leak is counted exactly."""
    trace = tmp_path / "t.kvtrace.json"
    proc = kvdoctor("run", "--trace", str(trace), "--", sys.executable, "-c", THEIR_IMPORT_HOOK, fault, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    planted = json.loads(proc.stdout.split("PLANTED ", 1)[1].splitlines()[0])
    replay = kvdoctor("replay", str(trace), "--format", "json")
    errors = [f for f in json.loads(replay.stdout)["findings"] if f["severity"] == "error"]
    if fault == "none":
        assert errors == []
    else:
        assert [(f["kind"], f["count"]) for f in errors] == [("orphan_slots", planted["orphan_slots"])]
