"""What the GPU tests share: whether a CUDA device is here, where each SGLang release is installed,
and running one check in a process of its own (its JSON verdict, its trace's findings)."""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SUPPORT = os.path.join(REPO, "tests", "support")
HARNESS = os.path.join(HERE, "harness")
BUGS = os.path.join(HERE, "bugs")
sys.path.insert(0, os.path.join(REPO, "bench", "gpu"))
from common import compute_sanitizer, memcheck_error_counts  # noqa: E402  (bench/gpu/common.py: the GPU server suite's too)

# Where tests/gpu/run.sh installs each release's carried wheels (SITE_059 overrides /tmp/site, and so
# on); SGLang 0.5.7 and 0.5.8 take the packages they lack from 0.5.9's folder.
SITE_DEFAULTS = {"0.5.9": "/tmp/site", "0.5.23": "/tmp/site23", "0.5.7": "/tmp/sg-0.5.7", "0.5.8": "/tmp/sg-0.5.8"}
SHARES_059 = ("0.5.7", "0.5.8")


def site(release: str) -> str:
    return os.environ.get("SITE_" + release.replace(".", ""), SITE_DEFAULTS[release])


@functools.cache
def cuda_missing() -> str:
    """Why no test here can run ('' when a CUDA device is here)."""
    try:
        import torch
    except Exception as exc:  # any failure to import torch: no device to test on
        return f"no CUDA device: torch does not import ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available():
        return f"no CUDA device: torch {torch.__version__} sees none (torch.cuda.is_available() is False); run on the GPU machine with `bash tests/gpu/run.sh`"
    return ""


def release_env(release: str) -> tuple[dict, str]:
    """The environment of a check process importing SGLang `release`, and '' ; or ({}, why not).
    The release's folder comes first, then (0.5.7, 0.5.8) 0.5.9's for what they lack, the checkout,
    and tests/support last (the import-only sgl_kernel, found only where no real one is)."""
    folder = site(release)
    if os.path.isdir(os.path.join(folder, "sglang")):
        path = [folder]
        if release in SHARES_059:
            path.append(site("0.5.9"))
    elif _installed_sglang() == release:
        path = []
    else:
        var = "SITE_" + release.replace(".", "")
        return {}, (
            f"no SGLang {release} GPU install: {folder} (${var}) holds no sglang and this Python's is "
            f"{_installed_sglang() or 'none'}; `bash tests/gpu/run.sh` installs it from what travels (README.md)"
        )
    env = dict(os.environ)
    env.pop("KVDOCTOR_TRACE", None)
    env.update(PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([*path, REPO, SUPPORT])
    return env, ""


def _installed_sglang() -> str:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return ""


def plain_env() -> dict:
    """A check process that needs no SGLang: the checkout's kvdoctor."""
    env = dict(os.environ)
    env.pop("KVDOCTOR_TRACE", None)
    env.update(PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH", "")) if p)
    return env


def run(script: str, *args: str, env: dict, timeout: float, memcheck: bool = False) -> subprocess.CompletedProcess:
    """Runs a check script (a path under tests/gpu) with this Python, from the repository root;
    under compute-sanitizer's memcheck when asked (each tensor its own cudaMalloc, so that memcheck
    sees a buffer's end)."""
    command = [sys.executable, os.path.join(HERE, script), *args]
    if memcheck:
        command = [compute_sanitizer(), "--tool", "memcheck", "--print-limit", "20", *command]
        env = {**env, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    return subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def result(proc: subprocess.CompletedProcess) -> dict:
    """The check's verdict: its last `RESULT {json}` line, or its last line that is a JSON object."""
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"the check printed no verdict (rc {proc.returncode}): {proc.stderr[-3000:]}")


def memcheck_errors(proc: subprocess.CompletedProcess) -> int:
    """memcheck's error count (its ERROR SUMMARY line); -1 when it printed none (a process killed
    before memcheck summed up)."""
    counts = memcheck_error_counts(proc.stdout + proc.stderr)
    return counts[-1] if counts else -1


def findings(trace: str) -> dict[str, dict]:
    """The trace's findings by kind, as `kvdoctor replay` judges them."""
    from kvdoctor.analysis.analyzer import analyze
    from kvdoctor.trace.reader import iter_events

    return {f.kind: {"count": f.count, "message": f.message, "evidence": f.evidence} for f in analyze(iter_events(trace)).findings}
