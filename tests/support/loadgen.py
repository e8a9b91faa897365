"""A small load client for an OpenAI-compatible completions server on this machine (vLLM's API
server): token-id prompts that share prefixes (so prefix caching shares KV blocks across
requests), a fixed number of worker threads, a bounded number of requests, stdlib only.

It talks only to localhost: a host other than 127.0.0.1 / ::1 / localhost is refused.

    import loadgen
    prompts = loadgen.make_prompts(300, seed=0)
    stats = loadgen.drive("http://127.0.0.1:8000", prompts, concurrency=8, max_tokens=8)
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}
MAX_REQUESTS = 100_000
MAX_CONCURRENCY = 64


def check_local(base_url: str) -> str:
    parsed = urllib.parse.urlparse(base_url)
    if parsed.scheme != "http" or parsed.hostname not in LOCAL_HOSTS:
        raise ValueError(f"loadgen only talks to a local http server, not {base_url!r}")
    return base_url.rstrip("/")


def make_prompts(
    count: int, *, seed: int = 0, groups: int = 6, prefix_len: int = 256, suffix_len: tuple[int, int] = (8, 96), vocab: int = 512
) -> list[list[int]]:
    """`count` token-id prompts in `groups` families: each family shares its first `prefix_len`
    tokens, then every prompt has its own suffix. Token ids avoid 0..2 (special ids)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(prefix_len)] for _ in range(max(1, groups))]
    prompts = []
    for _i in range(min(count, MAX_REQUESTS)):
        prefix = prefixes[rng.randrange(len(prefixes))]
        # some prompts take only part of the family prefix, so hits end mid-prefix too
        cut = prefix_len if rng.random() < 0.7 else rng.randrange(prefix_len // 2, prefix_len)
        suffix = [rng.randrange(3, vocab) for _ in range(rng.randint(*suffix_len))]
        prompts.append(prefix[:cut] + suffix)
    return prompts


def wait_healthy(base_url: str, timeout_s: float = 240.0, proc: Any = None) -> float:
    """Polls /health until it answers 200; returns the seconds waited. `proc` (a Popen) that
    exits meanwhile ends the wait with an error."""
    base = check_local(base_url)
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{base} not healthy after {timeout_s:.0f} s")


def complete(base_url: str, model: str, prompt: list[int], max_tokens: int, timeout_s: float = 120.0) -> dict[str, Any]:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}).encode()
    req = urllib.request.Request(
        check_local(base_url) + "/v1/completions", data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def model_name(base_url: str) -> str:
    with urllib.request.urlopen(check_local(base_url) + "/v1/models", timeout=10) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def drive(
    base_url: str,
    prompts: list[list[int]],
    *,
    concurrency: int = 8,
    max_tokens: int = 8,
    model: str | None = None,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """Sends every prompt once from `concurrency` threads; returns counts, errors and requests/s."""
    base = check_local(base_url)
    model = model or model_name(base)
    prompts = prompts[:MAX_REQUESTS]
    concurrency = max(1, min(concurrency, MAX_CONCURRENCY))
    lock = threading.Lock()
    state = {"next": 0, "ok": 0, "errors": 0, "completion_tokens": 0, "first_error": ""}

    def worker() -> None:
        while True:
            with lock:
                i = state["next"]
                if i >= len(prompts):
                    return
                state["next"] = i + 1
            try:
                out = complete(base, model, prompts[i], max_tokens, timeout_s)
                tokens = int(out.get("usage", {}).get("completion_tokens", 0))
                with lock:
                    state["ok"] += 1
                    state["completion_tokens"] += tokens
            except Exception as exc:  # counted, never raised: the caller decides what errors mean
                with lock:
                    state["errors"] += 1
                    state["first_error"] = state["first_error"] or f"{type(exc).__name__}: {exc}"[:300]

    start = time.monotonic()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    return {
        "requests": len(prompts),
        "ok": state["ok"],
        "errors": state["errors"],
        "first_error": state["first_error"],
        "completion_tokens": state["completion_tokens"],
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(state["ok"] / elapsed, 3) if elapsed > 0 else 0.0,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
    }
