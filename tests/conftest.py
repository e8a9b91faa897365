import json
import os
import signal
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUPPORT = os.path.join(REPO, "tests", "support")
SGLANG_059 = os.path.join(REPO, ".venv", "sglang-0.5.9")
RELEASES = os.path.join(REPO, ".venv", "sglang-releases")


def run_for_result(command: list, *, env: dict, cwd: str, timeout: float) -> dict:
    """Runs a case script that ends by printing `RESULT {json}`; its last RESULT, or the test fails
    with the end of the script's stderr."""
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


def release_case_runs(script: str, folder: str, prefix: str, cases: dict) -> dict:
    """Runs `tests/support/<script>` once per release, all at once, each writing one trace per case
    (`cases`: {release: [case, ...]}), with the release's SGLang and this checkout's kvdoctor in
    front. {release: ({case: events}, the script's RESULT)}."""
    from kvdoctor.trace.reader import iter_events

    started = {}
    for release, names in cases.items():
        traces = {case: os.path.join(folder, f"{prefix}-{release}-{case}.kvtrace.json") for case in names}
        env = sglang_env(release)
        command = [sys.executable, os.path.join(SUPPORT, script), *traces.values()]
        started[release] = (traces, subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = {}
    for release, (traces, proc) in started.items():
        stdout, stderr = proc.communicate(timeout=300)
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, stderr[-3000:]
        out[release] = ({case: list(iter_events(path)) for case, path in traces.items()}, json.loads(lines[-1][len("RESULT ") :]))
    return out


def error_findings(events: list) -> list:
    """The error findings of a trace's events, as `kvdoctor replay` would judge them."""
    from kvdoctor.analysis.analyzer import analyze

    return [f for f in analyze(iter(events)).findings if f.severity == "error"]


# What a case's own process does to its memory while it imports SGLang and torch: on a loaded 2-core
# machine the import outlasts the 60 s warm-up, and the Python heap still grows past it.
CASE_PROCESS_MEMORY = frozenset({"memory_growth", "memory_class_growth"})


def silent_on_the_case(findings: list) -> list:
    """The errors and warnings a case must not have: every one but its own process's memory growth,
    which a test of a ledger does not judge (the memory tests do, with their own parameters)."""
    return [f for f in findings if f.severity in ("error", "warning") and f.kind not in CASE_PROCESS_MEMORY]


def judges_every_slot_ledger(events: list) -> bool:
    """The probe's last coverage line says its one slot ledger judges orphans."""
    from kvdoctor.trace import schema

    coverage = [e.args["reason"] for e in events if e.name == schema.PROBE_STATUS and e.args.get("component") == "coverage"]
    return coverage[-1] == "coverage: 1 of 1 slot ledger(s) judge orphans"


def trace_events(path: str, name: str) -> list:
    """The events named `name` in the trace at `path` as raw dicts, complete lines only (a trace
    still being written ends in a cut line); [] before the file exists."""
    out = []
    if os.path.exists(path):
        with open(path) as fh:
            for line in fh:
                if line.startswith("{") and line.endswith("\n"):
                    raw = json.loads(line.rstrip().rstrip(","))
                    if raw["name"] == name:
                        out.append(raw)
    return out


@pytest.fixture(scope="session")
def needs_sglang_server():
    """Skips, saying why, where a real SGLang server cannot start here: asked once per worker, before
    any fixture of a narrower scope starts a server."""
    if SUPPORT not in sys.path:
        sys.path.insert(0, SUPPORT)
    import sglang_server

    reason = sglang_server.available()
    if reason:
        pytest.skip(reason)


# The probe's memory-class readings turn themselves off, said as information, the first time one
# takes more than its CPU budget (2 ms). On a loaded 2-core machine one reading now and then does,
# and a test that expects exactly its own findings (or a reading every period) would then depend on
# the machine's load. Every process the tests start gets a budget no reading here comes near; the
# budget rule itself is tested with a budget of its own (`test_memory_classes.py`).
TEST_MEMORY_CLASSES_BUDGET_MS = "250"


# The files that take longest, longest first (test seconds of a whole run, two workers). The two
# workers take files in collection order, and a long file started last leaves the other worker idle
# for its length; xdist's own order (most tests first) put the few-test server files last. Started
# first, the short files fill in behind them. `.ci/test` turns xdist's reordering off for this.
LONGEST_FIRST = (
    "tests/integration/test_release_matrix.py",
    "tests/e2e/test_sglang_server.py",
    "tests/integration/test_vllm_ledger.py",
    "tests/e2e/test_readme_gate.py",
    "tests/e2e/test_vllm_e2e.py",
    "tests/e2e/test_attach.py",
    "tests/e2e/test_coverage_servers.py",
    "tests/e2e/test_attach_paths.py",
    "tests/e2e/test_swa_server.py",
    "tests/integration/test_vllm_containers.py",
    "tests/integration/test_lora_pool.py",
    "tests/integration/test_vllm_hybrid.py",
    "tests/integration/test_vllm_mamba_index.py",
    "tests/integration/test_mm_inputs.py",
    "tests/integration/test_mamba_slots.py",
    "tests/integration/test_pd_decode.py",
    "tests/integration/test_swa_pool.py",
    "tests/integration/test_retract_paths.py",
    "tests/integration/test_spec_v1_release.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: n for n, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: a file stays in one piece


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than ~20 s")
    as_a_terminals_foreground_job()
    os.environ.setdefault("KVDOCTOR_MEMORY_CLASSES_BUDGET_MS", TEST_MEMORY_CLASSES_BUDGET_MS)


def as_a_terminals_foreground_job() -> None:
    """SIGINT and SIGQUIT as a command typed at a terminal has them. A suite started in the
    background by a script (`cmd &` in a non-interactive shell) has both ignored, and every process
    it starts would inherit that: the servers the tests stop as Ctrl-C does (SIGINT) would not stop,
    and `kvdoctor run` rightly leaves a signal it was started ignoring alone."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN:
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def sglang_env(version: str) -> dict:
    """An environment whose Python imports the given real SGLang version."""
    env = dict(os.environ)
    env.pop("KVDOCTOR_TRACE", None)
    if version == "0.5.9":
        if not os.path.isdir(SGLANG_059):
            pytest.skip("SGLang 0.5.9 is not installed beside the venv (run .ci/setup)")
        # 0.5.9 imports sgl_kernel at module load; tests/support/sgl_kernel is an import-only stand-in
        # (any kernel call raises); the CPU paths under test call none.
        env["PYTHONPATH"] = os.pathsep.join([SGLANG_059, SUPPORT, REPO])
    elif version != "0.5.23":  # the release matrix: each release in its own folder (.ci/setup)
        folder = os.path.join(RELEASES, version)
        assert os.path.exists(os.path.join(folder, ".kvdoctor-complete")), f"SGLang {version} is not in {folder}: run .ci/setup"
        env["PYTHONPATH"] = os.pathsep.join([folder, SUPPORT, REPO])
    else:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), REPO) if p)
    # REPO last: the checkout under test is the kvdoctor imported (the editable install may point at
    # another checkout), behind the release's own sglang and the stand-ins
    return env


def run_cases(version: str, cases: list, **env: str) -> list:
    proc = subprocess.run(
        [sys.executable, os.path.join(SUPPORT, "workload_cases.py"), json.dumps(cases)],
        env={**sglang_env(version), **env},
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return json.loads(line[-1][len("RESULT ") :])
