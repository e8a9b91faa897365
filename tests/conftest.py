import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUPPORT = os.path.join(REPO, "tests", "support")
SGLANG_059 = os.path.join(REPO, ".venv", "sglang-0.5.9")
RELEASES = os.path.join(REPO, ".venv", "sglang-releases")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than ~20 s")


def sglang_env(version: str) -> dict:
    """An environment whose Python imports the given real SGLang version."""
    env = dict(os.environ)
    env.pop("KVDOCTOR_TRACE", None)
    if version == "0.5.9":
        if not os.path.isdir(SGLANG_059):
            pytest.skip("SGLang 0.5.9 is not installed beside the venv (run .ci/setup)")
        # 0.5.9 imports sgl_kernel at module load; tests/support/sgl_kernel is an import-only stand-in
        # (any kernel call raises); the CPU paths under test call none.
        env["PYTHONPATH"] = os.pathsep.join([SGLANG_059, SUPPORT])
    elif version != "0.5.23":  # the release matrix: each release in its own folder (.ci/setup)
        folder = os.path.join(RELEASES, version)
        assert os.path.exists(os.path.join(folder, ".kvdoctor-complete")), f"SGLang {version} is not in {folder}: run .ci/setup"
        env["PYTHONPATH"] = os.pathsep.join([folder, SUPPORT])
    return env


def run_cases(version: str, cases: list) -> list:
    proc = subprocess.run(
        [sys.executable, os.path.join(SUPPORT, "workload_cases.py"), json.dumps(cases)],
        env=sglang_env(version),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return json.loads(line[-1][len("RESULT ") :])
