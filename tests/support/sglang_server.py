"""Starts a real SGLang 0.5.23 server on this CPU machine (`python -m sglang.launch_server --device
cpu`, the tiny local model in `.venv/sglang-tiny-model`), optionally under `kvdoctor run`, drives
it with SGLang's own `bench_serving` and with a client of shared prefixes, aborts and long prompts,
and stops it the way an operator would (SIGINT).

Faults are planted by `tests/support/sglang_fault/sitecustomize.py` (put on the server's PYTHONPATH):
`fault="leak"` skips one `free`, `"double-free"` repeats one, `"stale-last-loc"` and
`"index-out-of-range"` change one `last_loc` handed to `alloc_decode`; what was planted is written
to `fault.json`. `attach_on_signal=True` lets the test put the probe in later (SIGUSR2 to the
scheduler runs the very code `kvdoctor attach` injects), for a server started without it.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from typing import Any

import loadgen
import servers
from servers import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUPPORT = os.path.join(REPO, "tests", "support")
FAULT_DIR = os.path.join(SUPPORT, "sglang_fault")
PYTHON = os.path.join(REPO, ".venv", "bin", "python")
MODEL_DIR = os.path.join(REPO, ".venv", "sglang-tiny-model")
SWA_MODEL_DIR = os.path.join(REPO, ".venv", "sglang-tiny-swa-model")  # made on first use (a sliding-window Mellum)
LFM2_MODEL_DIR = os.path.join(REPO, ".venv", "sglang-tiny-lfm2-model")  # made on first use (a hybrid LFM2)
# The pool is sized by --max-total-tokens (every server here passes it). SGLang's CPU profile counts
# the host's available memory before and after loading the weights, so a server or model another
# test loads meanwhile counts as weights: at 0.05 a concurrent 1.1 GB made a start fail ("Loaded
# weights leave no GPU memory for the KV cache"). 0.25 leaves room for that; the pool is the same.
MEM_FRACTION = "0.25"
BASE_FLAGS = ["--device", "cpu", "--host", "127.0.0.1", "--mem-fraction-static", MEM_FRACTION, "--sleep-on-idle", "--log-level", "warning"]


@functools.cache
def available() -> str:
    """'' when a server can start here, else why not. It imports the server's modules in a child
    (about 20 s of CPU), so it is asked once per process, and only by a test that is about to run
    (the `needs_sglang_server` fixture): a check at collection ran in every worker for every file
    that names it, twice each, whether or not that worker ran the file."""
    if not os.path.exists(os.path.join(MODEL_DIR, "config.json")):
        return f"{MODEL_DIR} is missing: run .ci/setup (it makes the tiny model)"
    probe = subprocess.run(
        [PYTHON, "-c", "import fastapi, uvicorn, sglang.srt.entrypoints.http_server"], capture_output=True, env=server_env({}), timeout=120
    )
    if probe.returncode != 0:
        return "the SGLang server's packages do not import: run .ci/setup (" + probe.stderr.decode()[-300:] + ")"
    return ""


def ensure_lfm2_model() -> str:
    if not os.path.exists(os.path.join(LFM2_MODEL_DIR, "config.json")):
        subprocess.run(
            [PYTHON, os.path.join(SUPPORT, "sglang_model.py"), LFM2_MODEL_DIR, "lfm2"], check=True, capture_output=True, timeout=600
        )
    return LFM2_MODEL_DIR


def ensure_swa_model() -> str:
    if not os.path.exists(os.path.join(SWA_MODEL_DIR, "config.json")):
        subprocess.run(
            [PYTHON, os.path.join(SUPPORT, "sglang_model.py"), SWA_MODEL_DIR, "swa"], check=True, capture_output=True, timeout=600
        )
    return SWA_MODEL_DIR


def vocab_size() -> int:
    with open(os.path.join(MODEL_DIR, "config.json")) as fh:
        return int(json.load(fh)["vocab_size"])


def server_env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    for key in list(env):
        if key.startswith("KVDOCTOR_"):
            del env[key]
    env.update(
        {
            "SGLANG_USE_CPU_ENGINE": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([FAULT_DIR, SUPPORT, REPO]),
        }
    )  # the fault sitecustomize; the sgl_kernel stand-in; this checkout's kvdoctor (whatever is installed)
    env.update(extra)
    return env


class Server(servers.ServerRun):
    """One server run; `flags` are SGLang's (page size, radix cache, chunked prefill, policy)."""

    stop_timeout_s = 120.0

    def __init__(
        self,
        workdir: str,
        *,
        flags: list[str] | None = None,
        probe: bool = True,
        fault: str = "",
        fault_at: int | str = 0,
        attach_on_signal: bool = False,
        max_total_tokens: int = 16384,
        model: str = MODEL_DIR,
        env: dict[str, str] | None = None,
        metrics: bool = False,
    ) -> None:
        self.workdir = workdir
        self.metrics_address = f"127.0.0.1:{free_port()}" if metrics else ""  # `kvdoctor run --metrics` there
        self.model = model
        self.flags = list(flags or [])
        self.probe = probe
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.trace = os.path.join(workdir, "sglang.kvtrace.json")
        self.fault_out = os.path.join(workdir, "fault.json")
        self.attach_params = os.path.join(workdir, "attach-params.json")
        self.log_path = os.path.join(workdir, "server.log")
        self.extra_env = {"KVDOCTOR_TEST_FAULT": fault, "KVDOCTOR_TEST_FAULT_AT": str(fault_at), "KVDOCTOR_TEST_FAULT_OUT": self.fault_out}
        if fault:
            # SGLang's own idle check ends the scheduler at the first leak it counts; the planted
            # fault is for kvdoctor to name, on a server that keeps serving. Clean runs keep it on.
            self.extra_env["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"] = "false"
        if attach_on_signal:
            self.extra_env["KVDOCTOR_TEST_ATTACH_PARAMS"] = self.attach_params
        self.extra_env.update(env or {})
        self.max_total_tokens = max_total_tokens
        self.proc: subprocess.Popen | None = None
        self._log: Any = None
        self.returncode: int | None = None

    def command(self) -> list[str]:
        serve = [
            PYTHON,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model,
            "--port",
            str(self.port),
            "--max-total-tokens",
            str(self.max_total_tokens),
            *BASE_FLAGS,
            *self.flags,
        ]
        if not self.probe:
            return serve
        metrics = ["--metrics", self.metrics_address] if self.metrics_address else []
        return [PYTHON, "-m", "kvdoctor.cli", "run", "--trace", self.trace, *metrics, "--"] + serve

    def start(self, timeout_s: float = 240.0) -> Server:
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.command(),
            env=server_env(self.extra_env),
            cwd=self.workdir,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            loadgen.wait_healthy(self.base_url, timeout_s, proc=self.proc)
        except Exception:
            self.stop()
            raise RuntimeError(f"SGLang server did not come up; log tail:\n{self.log_tail()}") from None
        return self

    def scheduler_pid(self) -> int | None:
        assert self.proc is not None
        for pid, title in servers.descendants(self.proc.pid).items():
            if title.startswith("sglang::scheduler"):
                return pid
        return None

    def generate(self, input_ids: list[int], max_new_tokens: int, *, timeout_s: float = 120.0) -> dict[str, Any]:
        body = json.dumps(
            {"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}}
        ).encode()
        request = urllib.request.Request(self.base_url + "/generate", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return json.loads(resp.read())

    def conversations(self, turns: int = 3, users: int = 6, *, long_every: int = 4, abort_every: int = 5, seed: int = 0) -> dict[str, int]:
        """Multi-turn chats from `users` threads: each turn resends the whole history (shared
        prefixes for the radix tree), every `long_every`-th user sends long prompts (evictions,
        retractions on a small pool), every `abort_every`-th request is abandoned mid-flight."""
        prompts = loadgen.make_prompts(users, seed=seed, groups=2, prefix_len=64, suffix_len=(8, 32), vocab=vocab_size())
        counts = {"ok": 0, "aborted": 0, "errors": 0}
        lock = threading.Lock()

        def user(number: int) -> None:
            history = list(prompts[number])
            if long_every and number % long_every == long_every - 1:
                history = history * 12
            for turn in range(turns):
                abandon = abort_every and (number * turns + turn) % abort_every == abort_every - 1
                try:
                    out = self.generate(history, 48, timeout_s=0.05 if abandon else 120.0)
                    history += out.get("output_ids", [])[:16] + prompts[(number + turn) % len(prompts)][:12]
                    key = "ok"
                except Exception:
                    key = "aborted" if abandon else "errors"
                with lock:
                    counts[key] += 1

        threads = [threading.Thread(target=user, args=(n,)) for n in range(users)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return counts

    def bench_serving(self, prompts: int = 48, concurrency: int = 8) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                PYTHON,
                "-m",
                "sglang.bench_serving",
                "--backend",
                "sglang",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--model",
                MODEL_DIR,
                "--tokenizer",
                MODEL_DIR,
                "--dataset-name",
                "random-ids",
                "--num-prompts",
                str(prompts),
                "--random-input-len",
                "96",
                "--random-output-len",
                "24",
                "--max-concurrency",
                str(concurrency),
                "--disable-tqdm",
            ],
            env=server_env({}),
            capture_output=True,
            text=True,
            timeout=600,
            cwd=self.workdir,
        )

    def attach_now(self, trace: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """Puts the probe into the running scheduler with the code `kvdoctor attach` injects."""
        from kvdoctor import PACKAGE_ROOT

        status = os.path.join(self.workdir, "attach-status.json")
        with open(self.attach_params, "w") as fh:
            json.dump({"trace_path": trace, "fixes": [], "attribution": False, "status_path": status, "package_root": PACKAGE_ROOT}, fh)
        pid = self.scheduler_pid()
        assert pid, "no sglang::scheduler process"
        os.kill(pid, signal.SIGUSR2)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if os.path.exists(status):
                with open(status) as fh:
                    return json.load(fh)
            time.sleep(0.2)
        raise TimeoutError("the scheduler did not answer the attach")


replay = servers.replay


# The decode side of prefill/decode disaggregation on CPU: the fake transfer backend, and a host
# backup for retractions (the default host pool calls cudaHostRegister).
DECODE_FLAGS = [
    "--disaggregation-mode",
    "decode",
    "--disaggregation-transfer-backend",
    "fake",
    "--disaggregation-decode-retraction-backup",
    "cpu_tensor",
]


def generate_with_bootstrap(base_url: str, number: int, new_tokens: int = 150) -> int:
    """One request to a decode server (40 prompt tokens, `number` varies them): the fake backend
    needs the bootstrap fields, never the address. The number of tokens it produced."""
    body = {
        "input_ids": [5 + (number * 7 + k) % 300 for k in range(40)],
        "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True},
        "bootstrap_host": "2.2.2.2",
        "bootstrap_port": 8998,
        "bootstrap_room": 1000 + number,
    }
    request = urllib.request.Request(base_url + "/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as resp:
        return len(json.loads(resp.read()).get("output_ids", []))
