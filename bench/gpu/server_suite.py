"""A whole real SGLang 0.5.23 server (`python3 -m sglang.launch_server`) on the GPU under `kvdoctor run`,
with SGLang's GPU defaults (the overlap scheduler and CUDA graphs on), in the cases of issue #47:

- clean-*: served by SGLang's own `bench_serving` and multi-turn chats with shared prefixes, aborts
  and long prompts (tests/support/sglang_server.py's clients); verdict: 0 error findings, and every
  census balanced against SGLang's own counters (the allocator's free list, the tree's evictable
  and protected sizes): the ledger's free slots are the host's, and at idle total = free + tree;
- fault-leak / fault-safety: the CPU e2e suite's planted faults (tests/support/sglang_fault), a
  dropped free, a double free (with a stale last_loc and an out-of-range index in the same server),
  each judged against what was planted: count, slots, request, site;
- cost-{off,on}-N: `bench_serving` on fresh servers without and with the probe, measured one at a
  time in alternating order (the others idle beside it), plus the GPU and host memory of the
  scheduler process.

    python3 bench/gpu/server_suite.py --out DIR [--cases a,b,...] [--cpu]

The first case starts alone (its JIT kernels and Triton cache serve the others), then every other
case starts at once; correctness loads run side by side, then the cost benchmarks one at a time.
Each case's result, the kvdoctor trace and replay of the correctness cases, and the server logs go
to DIR; DIR/summary.json and DIR/summary.md hold the verdicts. Exit 0 when every case holds.
`--cpu` runs the same plumbing here with `--device cpu` (a check of the suite, not a result).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

REPO = os.environ.get("KVDOCTOR_SRC") or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUPPORT = os.path.join(REPO, "tests", "support")
sys.path.insert(0, SUPPORT)

import servers  # noqa: E402
import sglang_server  # noqa: E402
from common import compute_sanitizer, memcheck_error_counts  # noqa: E402  (bench/gpu/common.py, beside this file)

HERE = os.path.dirname(os.path.abspath(__file__))
CARRY = os.environ.get("SERVER_CARRY") or os.path.join(os.path.dirname(os.path.dirname(HERE)), ".carry", "server")
GPU_FLAGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--host", "127.0.0.1", "--log-level", "warning"]
CPU_FLAGS = ["--device", "cpu", "--host", "127.0.0.1", "--sleep-on-idle", "--log-level", "warning"]
SAFETY = "double-free,stale-last-loc,index-out-of-range"
HICACHE = ["--enable-hierarchical-cache", "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first"]
HICACHE += ["--hicache-storage-backend", "file", "--hicache-write-policy", "write_through", "--hicache-ratio", "2"]
# SGLang's own test knob: a torch.cuda._sleep of this many cycles before each layer's host-to-device copy
DELAY = {"SGLANG_TEST_HICACHE_H2D_DELAY_CYCLES": "20000000"}
QUIET = {
    "KVDOCTOR_WRITER_INTERVAL_S": "60",
    "KVDOCTOR_MEMORY_CLASSES": "0",
    "KVDOCTOR_CONTAINERS": "0",
    "KVDOCTOR_ROLLING_CENSUS_S": "86400",
}
THREADS_DIR = os.path.join(HERE, "server_threads")


@dataclass
class Case:
    name: str
    kind: str  # clean | leak | row_leak | pd_decode | safety | hicache | hicache_l3 | attach | memcheck | cost
    flags: list[str] = field(default_factory=list)
    probe: bool = True
    fault: str = ""
    fault_at: int | str = 0
    model: str = "model"
    max_total_tokens: int = 65536
    mem_fraction: str = ""  # the suite's --mem-fraction where empty
    alone: bool = False  # started only once every other case has stopped, one at a time (a big model)
    env: dict[str, str] = field(default_factory=dict)  # the server's (SGLang's knobs, the probe's switches)
    threads: bool = True  # server_threads/: CPU seconds per thread and the native path's counters
    memcheck: bool = False  # the server under compute-sanitizer's memcheck (every process it starts)


def _cases() -> dict[str, Case]:
    cases = [
        Case("clean-p1", "clean"),
        Case("clean-p16", "clean", ["--page-size", "16"]),
        Case("clean-noradix", "clean", ["--page-size", "16", "--disable-radix-cache"]),
        Case("clean-chunked", "clean", ["--page-size", "16", "--chunked-prefill-size", "64", "--schedule-policy", "fcfs"]),
        Case("clean-p1-chunked", "clean", ["--chunked-prefill-size", "64"]),
        Case("hicache", "hicache", ["--page-size", "16", *HICACHE], max_total_tokens=6144),
        # host pool evictions and L3 prefetches: more 512-token prompts than the host pool holds, then the first again
        Case("hicache-l3", "hicache_l3", ["--page-size", "16", *HICACHE], max_total_tokens=6144),
        Case("hicache-delay", "hicache", ["--page-size", "16", *HICACHE], max_total_tokens=6144, env=DELAY),
        Case(
            "hicache-delay-guard",
            "hicache",
            ["--page-size", "16", *HICACHE],
            max_total_tokens=6144,
            env={**DELAY, "KVDOCTOR_FIXES": "graph-guard"},
        ),
        Case("fault-leak", "leak", ["--disable-radix-cache"], fault="leak", fault_at=20),
        # the 20th request's ReqToTokenPool.free skipped: its slots go back, its row never (request_rows_leaked)
        Case("fault-row-leak", "row_leak", ["--page-size", "16"], fault="row-leak", fault_at=20),
        # the decode side of a PD pair (the fake transfer backend), clean: its DecodeReqToTokenPool judged as the request pool
        Case("pd-decode", "pd_decode", sglang_server.DECODE_FLAGS),
        # and with a segment's free dropped (3rd) and, in another request, its row's free (5th)
        Case(
            "pd-decode-faults",
            "pd_decode",
            sglang_server.DECODE_FLAGS,
            fault="leak,row-leak",
            fault_at=3,
            env={"KVDOCTOR_TEST_FAULT_ROW_AT": "5"},
        ),
        # no probe at the start: `kvdoctor attach --gdb cuda-gdb` puts it in, one leak planted before and one after
        Case(
            "attach-leak",
            "attach",
            ["--page-size", "16", "--chunked-prefill-size", "64"],
            probe=False,
            fault="leak",
            fault_at="10,+2",
            max_total_tokens=4096,
            env={"KVDOCTOR_TEST_FAULT_REWRAP_SIGNAL": "1"},
        ),
        Case("fault-safety", "safety", ["--page-size", "16", "--disable-radix-cache"], fault=SAFETY, fault_at=20),
    ]
    # The out-of-range last_loc kept (one past the KV buffer, the host not put back), the server under
    # memcheck: the KV write past the buffer's end is memcheck's, the index named first is kvdoctor's;
    # `--fix clamp-last-loc` keeps the write inside. CUDA graphs off (memcheck and capture), each tensor
    # its own cudaMalloc (so memcheck knows where a buffer ends), the trace written every second.
    oor = {"KVDOCTOR_TEST_FAULT_OOR": "past-end", "PYTORCH_NO_CUDA_MEMORY_CACHING": "1", "KVDOCTOR_WRITER_INTERVAL_S": "1"}
    checked = ["--page-size", "16", "--disable-radix-cache", "--disable-cuda-graph"]
    for name, fixes in (("sanitizer-oor", {}), ("sanitizer-oor-clamp", {"KVDOCTOR_FIXES": "clamp-last-loc"})):
        cases.append(
            Case(
                name,
                "memcheck",
                checked,
                fault="index-out-of-range",
                fault_at=40,  # in the second of drive_memcheck's requests, past SGLang's own warm-up request
                max_total_tokens=4096,
                env={**oor, **fixes},
                memcheck=True,
            )
        )
    for n in range(1, 7):
        cases.append(Case(f"cost-off-{n}", "cost", ["--sleep-on-idle"], probe=False))
        cases.append(Case(f"cost-on-{n}", "cost", ["--sleep-on-idle"]))
        cases.append(Case(f"cost-quiet-{n}", "cost", ["--sleep-on-idle"], env=QUIET))  # the writer thread's rounds all but gone
        cases.append(Case(f"cost-py-{n}", "cost", ["--sleep-on-idle"], env={"KVDOCTOR_NATIVE": "0"}))  # every hooked call in Python
        cases.append(Case(f"cost-prof-{n}", "cost", ["--sleep-on-idle"], env={"SUITE_STACKS": "1"}))  # stacks sampled: not a timing
        for probe in (False, True):  # decode graphs up to the benchmark's 32 at a time (a shorter capture)
            big = ["--sleep-on-idle", "--load-format", "dummy", "--cuda-graph-max-bs-decode", "32"]
            name = f"cost8b-{'on' if probe else 'off'}-{n}"
            cases.append(Case(name, "cost", big, probe=probe, model="model-8b", max_total_tokens=16384, mem_fraction="0.7", alone=True))
    return {c.name: c for c in cases}


CASES = _cases()


def server_env_for(cpu: bool, fault: bool, threads: bool = False):
    standins = os.path.join(CARRY, "standins")

    def env(extra: dict[str, str]) -> dict[str, str]:
        out = {k: v for k, v in os.environ.items() if not k.startswith("KVDOCTOR_") or k in ("KVDOCTOR_SRC",)}
        path = [sglang_server.FAULT_DIR] if fault else []
        path += [os.environ.get("SITE", ""), REPO, SUPPORT if cpu else standins, THREADS_DIR if threads else ""]
        out.update(
            {
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1",
                "PYTHONWARNINGS": "ignore",
                "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1",  # sgl-kernel is stood in (README.md)
                "PYTHONPATH": os.pathsep.join(p for p in path if p),
            }
        )
        if cpu:
            out["SGLANG_USE_CPU_ENGINE"] = "1"
        out.update(extra)
        return out

    return env


class GpuServer(sglang_server.Server):
    """tests/support's server run with this machine's python and flags (the clients are its own)."""

    def __init__(self, workdir: str, case: Case, cpu: bool, mem_fraction: str) -> None:
        self.case = case
        model = os.path.join(CARRY, case.model)
        flags = [*(CPU_FLAGS if cpu else GPU_FLAGS), "--mem-fraction-static", case.mem_fraction or mem_fraction, *case.flags]
        super().__init__(
            workdir,
            flags=flags,
            probe=case.probe,
            fault=case.fault,
            fault_at=case.fault_at,
            max_total_tokens=case.max_total_tokens,
            model=model,
            env={**case.env, **({"SUITE_THREADS_OUT": workdir} if case.threads else {})},
        )
        self._env = server_env_for(cpu, bool(case.fault), case.threads)
        self.stop_timeout_s = 180.0

    def start(self, timeout_s: float = 300.0) -> GpuServer:
        sglang_server.server_env = self._env
        return super().start(timeout_s * (3 if self.case.memcheck else 1))  # type: ignore[return-value]

    def command(self) -> list[str]:
        if not self.case.memcheck:
            return super().command()
        sanitizer = compute_sanitizer()
        if not sanitizer:
            raise RuntimeError("compute-sanitizer is not on the PATH nor in /usr/local/cuda/bin")
        log = os.path.join(self.workdir, "memcheck-%p.log")
        return [sanitizer, "--tool", "memcheck", "--target-processes", "all", "--print-limit", "20", "--log-file", log, *super().command()]


def memcheck_read(workdir: str) -> dict:
    """memcheck's logs, one a process: its error summaries and the first invalid accesses."""
    summaries, accesses, logs, reported = [], [], 0, 0
    for name in sorted(os.listdir(workdir)):
        if not (name.startswith("memcheck-") and name.endswith(".log")):
            continue
        with open(os.path.join(workdir, name), errors="replace") as fh:
            text = fh.read()
        logs += "COMPUTE-SANITIZER" in text
        summaries += memcheck_error_counts(text)
        accesses += re.findall(r"=+ (Invalid __global__ (?:write|read) of size \d+ bytes)", text)
        # each error as memcheck reports it, when it finds it (a process killed later sums nothing up)
        reported += len(
            re.findall(r"^=+ (?!COMPUTE-SANITIZER|ERROR SUMMARY|LEAK SUMMARY|Target application|\s)\S", text, flags=re.MULTILINE)
        )
    return {
        "summaries": summaries,
        "errors": sum(summaries),
        "invalid_accesses": len(accesses),
        "first": accesses[:4],
        "logs": logs,
        "errors_reported": reported,
    }


def _events(trace: str) -> list[dict]:
    out = []
    with open(trace) as fh:
        for line in fh:
            if line.startswith("{"):
                try:
                    out.append(json.loads(line.rstrip().rstrip(",")))
                except json.JSONDecodeError:
                    pass
    return out


def _errors(report: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in report.get("findings", []):
        if f["severity"] == "error":
            out[f["kind"]] = out.get(f["kind"], 0) + f["count"]
    return out


def censuses(trace: str) -> dict:
    """Every census against SGLang's own counters: the ledger's free slots are the allocator's
    free list (none only in one of them); at idle the pool is the free list plus the tree."""
    events = _events(trace)
    rows = [e["args"] for e in events if e["name"] == "census"]
    bad = []
    for a in rows:
        problems = []
        if a.get("ledger_disagrees_slots"):
            problems.append(f"ledger disagrees on {a['ledger_disagrees_slots']} slots")
        if "host_free_slots" in a and a["host_free_slots"] != a.get("free_slots"):
            problems.append(f"free {a.get('free_slots')} != host {a['host_free_slots']}")
        if a.get("idle") and "tree_evictable_slots" in a:
            diff = a["total_slots"] - a["host_free_slots"] - a["tree_evictable_slots"] - a["tree_protected_slots"]
            if diff:
                problems.append(f"idle: total - free - tree = {diff}")
        if problems:
            bad.append({"reason": a.get("reason"), "allocator": a.get("allocator"), "problems": problems})
    hooked: dict[str, int] = {}  # per process, the most hooks it reported (the scheduler's are the pools')
    for e in events:
        m = re.search(r"(\d+) methods hooked", str(e["args"].get("reason", ""))) if e["name"] == "probe_status" else None
        if m:
            hooked[str(e["pid"])] = max(hooked.get(str(e["pid"]), 0), int(m.group(1)))
    partial = [e["args"] for e in events if e["name"] == "probe_partial"]
    last = {}
    for a in rows:
        last[a.get("allocator")] = {
            k: a.get(k)
            for k in ("reason", "idle", "total_slots", "free_slots", "host_free_slots", "tree_slots", "owned_slots", "unaccounted_slots")
        }
        last[a.get("allocator")].update({k: a[k] for k in ("tree_evictable_slots", "tree_protected_slots") if k in a})
    return {
        "censuses": len(rows),
        "idle_censuses": sum(1 for a in rows if a.get("idle")),
        "by_reason": _count(a.get("reason") for a in rows),
        "unbalanced": bad[:10],
        "unbalanced_count": len(bad),
        "last": last,
        "hooked": hooked,
        "probe_partial": [{k: p.get(k) for k in ("component", "reason", "what")} for p in partial][:10],
        "violations": _count(e["args"].get("kind") for e in events if e["name"] == "violation"),
    }


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in items:
        out[str(i)] = out.get(str(i), 0) + 1
    return out


def probe_on(trace: str, timeout_s: float = 20.0) -> bool:
    """The probe reported its hooks in the scheduler (a server that starts without them would
    spend the device's time on nothing)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.exists(trace) and any(
            e["name"] == "probe_status" and "methods hooked" in str(e["args"].get("reason")) for e in _events(trace)
        ):
            return True
        time.sleep(0.5)
    return False


def wait_idle_census(trace: str, since_us: float, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.exists(trace) and any(e["name"] == "census" and e["args"].get("idle") and e["ts"] >= since_us for e in _events(trace)):
            return True
        time.sleep(0.5)
    return False


def drive(server: GpuServer, cpu: bool) -> dict:
    chats = server.conversations(turns=3 if not cpu else 2, users=8 if not cpu else 4)
    bench = server.bench_serving(prompts=128 if not cpu else 24, concurrency=16 if not cpu else 8)
    ok = re.search(r"Successful requests:\s+(\d+)", bench.stdout)
    since_us = time.time() * 1e6
    server.generate(list(range(5, 21)), 4)
    idle = wait_idle_census(server.trace, since_us) if server.probe else None
    return {"chats": chats, "bench_ok": int(ok.group(1)) if ok else 0, "bench_rc": bench.returncode, "idle_census_after_load": idle}


def drive_pd_decode(server: GpuServer, cpu: bool) -> dict:
    """Sixteen requests at once to the decode server, each carrying the bootstrap fields the fake
    backend needs, then one more (the idle scheduler's last batch replaced), then its idle census."""
    produced: list[int] = []
    failed: list[str] = []

    def one(n: int) -> None:
        try:
            produced.append(sglang_server.generate_with_bootstrap(server.base_url, n, 64))
        except Exception as exc:
            failed.append(str(exc)[:300])

    threads = [threading.Thread(target=one, args=(n,)) for n in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    since_us = time.time() * 1e6
    one(16)
    idle = wait_idle_census(server.trace, since_us) if server.probe else None
    return {"produced": sorted(produced), "failed": failed, "idle_census_after_load": idle}


def drive_memcheck(server: GpuServer, cpu: bool) -> dict:
    """Six requests one after another, each decoding 24 tokens (the fault hits the 40th decode call
    whose first request continues a page: SGLang's warm-up request makes fewer than 10); a server
    the bad write took down fails the rest, which is counted, not raised."""
    done, failed = 0, []
    for n in range(6):
        try:
            server.generate(list(range(5 + n, 30 + n)), 24, timeout_s=240.0)
            done += 1
        except Exception as exc:
            failed.append(str(exc)[:300])
    time.sleep(3.0)  # the trace's next round (every second here)
    return {"done": done, "failed": failed}


def drive_hicache(server: GpuServer, cpu: bool) -> dict:
    """Load-backs while decode graphs replay: 40 distinct 256-token prompts once (the device pool
    holds about a third of them: the rest are evicted, written through to the host and to L3), then
    the same prompts again (host hits: loaded back on the load stream) beside 8 long decodes."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    vocab = sglang_server.vocab_size()
    rng = random.Random(7)
    prompts = [[rng.randrange(5, vocab - 1) for _ in range(256)] for _ in range(40 if not cpu else 12)]
    failed: list[str] = []

    def send(job: tuple[list[int], int]) -> None:
        try:
            server.generate(job[0], job[1], timeout_s=300.0)
        except Exception as exc:
            failed.append(repr(exc)[:200])

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(send, [(p, 4) for p in prompts]))
    longs = [([rng.randrange(5, vocab - 1) for _ in range(16)], 200 if not cpu else 24) for _ in range(8)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(send, longs + [(p, 4) for p in prompts]))
    since_us = time.time() * 1e6
    server.generate(list(range(5, 21)), 4)
    idle = wait_idle_census(server.trace, since_us) if server.probe else None
    return {"requests": 2 * len(prompts) + len(longs), "failed": failed[:5], "failed_count": len(failed), "idle_census_after_load": idle}


def drive_hicache_l3(server: GpuServer, cpu: bool) -> dict:
    """Host pool evictions and L3 prefetches: 70 distinct 512-token prompts (more than the host pool
    holds: the oldest leave it, kept in L3), then the first 20 again (fetched back from L3 into
    freshly allocated host slots). 512, not 256: what a prefetch asks for is the prompt's matchable
    prefix past its host and device hits, page-aligned (240 tokens of a 256-token prompt at page 16),
    and SGLang issues none below its prefetch threshold (256 tokens by default)."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    vocab = sglang_server.vocab_size()
    rng = random.Random(11)
    prompts = [[rng.randrange(5, vocab - 1) for _ in range(512)] for _ in range(70 if not cpu else 16)]
    failed: list[str] = []

    def send(p: list[int]) -> None:
        try:
            server.generate(p, 4, timeout_s=300.0)
        except Exception as exc:
            failed.append(repr(exc)[:200])

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(send, prompts))
    time.sleep(2.0)  # the write-through to L3 of the last ones
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(send, prompts[:20]))
    since_us = time.time() * 1e6
    server.generate(list(range(5, 21)), 4)
    idle = wait_idle_census(server.trace, since_us) if server.probe else None
    return {"requests": len(prompts) + 20, "failed": failed[:5], "failed_count": len(failed), "idle_census_after_load": idle}


def drive_attach(server: GpuServer, cpu: bool) -> dict:
    """A server started without kvdoctor fills its tree (60 prompts of 120 tokens, more than the pool
    holds), `kvdoctor attach --gdb` puts the probe in (cuda-gdb on the GPU machine, which has no gdb),
    the planted fault is told (it wraps the probe's wrappers: what the host does, the probe sees), a
    second load evicts what the tree held, and the idle census after it counts every request."""
    import signal

    before = server.bench_serving(prompts=60, concurrency=16)
    pid = server.scheduler_pid()
    gdb = os.environ.get("SUITE_GDB", "/usr/local/cuda/bin/cuda-gdb")
    t0 = time.monotonic()
    att = subprocess.run(
        [sys.executable, "-m", "kvdoctor", "attach", str(pid), "--gdb", gdb, "--trace", server.trace],
        env=server._env({}),
        capture_output=True,
        text=True,
        timeout=240,
        cwd=server.workdir,
    )
    attach = {"rc": att.returncode, "s": round(time.monotonic() - t0, 1), "stdout": att.stdout[-800:], "stderr": att.stderr[-1500:]}
    if att.returncode != 0 or pid is None:
        return {"bench_rc": before.returncode, "attach": attach}
    os.kill(pid, signal.SIGUSR2)
    time.sleep(1.0)
    after = server.bench_serving(prompts=30, concurrency=16)
    since_us = time.time() * 1e6
    server.generate(list(range(5, 21)), 4)
    idle = wait_idle_census(server.trace, since_us)
    return {"bench_rc": before.returncode or after.returncode, "attach": attach, "idle_census_after_load": idle}


def hicache_counts(trace: str) -> dict:
    """The last HiCache counter of each probed process that has one (host pool, loads, backups)."""
    last: dict[str, dict] = {}
    for e in _events(trace):
        if e["name"] == "hicache" and e.get("ph") == "C":
            last[str(e["pid"])] = e["args"]
    return last


def judge(case: Case, result: dict, server: GpuServer) -> None:
    rc, report = servers.replay(server.trace)
    errors = _errors(report)
    result.update(replay_rc=rc, errors=errors, census=censuses(server.trace))
    result["probe_partial"] = [f["message"][:300] for f in report.get("findings", []) if f["kind"] == "probe_partial"]
    result["warnings"] = _count(f["kind"] for f in report.get("findings", []) if f["severity"] == "warning")
    with open(os.path.join(server.workdir, "replay.json"), "w") as fh:
        json.dump(report, fh)
    planted = server.fault() or {}
    result["planted"] = {
        k: {x: v.get(x) for x in ("count", "slot_ids", "last_loc", "page_size", "rid") if x in v} for k, v in planted.items()
    }
    why = []
    load = result.get("load", {})
    if case.kind not in ("hicache", "hicache_l3", "attach", "memcheck", "pd_decode") and (
        load.get("chats", {}).get("errors") or load.get("bench_rc") != 0
    ):
        why.append(f"load failed: {load}")
    c = result["census"]
    if case.kind == "attach":
        judge_attach(result, report, errors, planted, server.trace)
        c = result["census"]
        plants = planted.get("leak", {}).get("plants", [])
        totals = {sum(p["count"] for p in plants[:k]) for k in range(1, len(plants) + 1)}
        as_planted = [b for b in c["unbalanced"] if all(re.fullmatch(r"idle: total - free - tree = (\d+)", x) for x in b["problems"])]
        as_planted = [b for b in as_planted if all(int(x.rsplit("= ", 1)[1]) in totals for x in b["problems"])]
        c["leak_as_planted"] = len(as_planted)
        c["unbalanced_count"] -= len(as_planted)
    if case.kind in ("leak", "pd_decode") and planted.get("leak"):  # the leak itself: total - free - tree is what was dropped
        want = f"idle: total - free - tree = {planted['leak']['count']}"
        c["leak_as_planted"] = sum(1 for b in c["unbalanced"] if b["problems"] == [want])
        c["unbalanced_count"] -= c["leak_as_planted"]
    if not c["censuses"] or c["unbalanced_count"]:
        why.append(f"censuses: {c['censuses']}, unbalanced {c['unbalanced_count']}")
    why.extend(result.get("attach_why", []))
    if case.kind in ("hicache", "hicache_l3"):
        counts = hicache_counts(server.trace)
        result["hicache"] = counts
        events = _events(server.trace)
        replays = [e["args"] for e in events if e["name"] == "violation" and e["args"].get("kind") == "graph_replay_during_load"]
        result["replays_during_load"] = {"count": len(replays), "first": replays[:4]}
        result["fixes"] = [e["args"] for e in events if e["name"] == "fix_applied"][:8]
        if load.get("failed_count"):
            why.append(f"{load['failed_count']} requests failed: {load['failed']}")
        if not any(int(c.get("loads", 0) or 0) for c in counts.values()):
            why.append(f"no load back seen: the case did not test one ({counts})")
        if case.name in ("hicache", "hicache-l3") and (errors or rc != 0):
            why.append(f"errors {errors} rc {rc}")
        if case.kind == "hicache_l3" and not all(
            any(int(c.get(k, 0) or 0) for c in counts.values()) for k in ("host_frees", "storage_gets")
        ):
            why.append(f"no host pool free or no L3 get seen: the case did not test them ({counts})")
    if case.kind == "clean":
        if errors or rc != 0:
            why.append(f"errors {errors} rc {rc}")
    elif case.kind == "pd_decode":
        coverage = [e["args"] for e in _events(server.trace) if e["name"] == "probe_status" and e["args"].get("component") == "coverage"]
        result["coverage"] = {k: coverage[-1].get(k) for k in ("state", "ledgers", "engine_pools")} if coverage else {}
        if load.get("failed") or load.get("produced") != [64] * 17:
            why.append(f"load failed: {load}")
        want = {"orphan_slots": planted.get("leak", {}).get("count"), "request_rows_leaked": 1} if case.fault else {}
        result["named"] = [_named(f) for f in report["findings"] if f["severity"] == "error"]
        if errors != want or rc != (1 if case.fault else 0):
            why.append(f"errors {errors} rc {rc}, want {want}")
        if not coverage or set(coverage[-1].get("ledgers", {}).values()) != {"judged"}:
            why.append(f"not judged: {result['coverage']}")
    elif case.kind == "leak":
        leak = planted.get("leak")
        if not leak:
            why.append("no leak planted")
        else:
            named = [f for f in report["findings"] if f["kind"] == "orphan_slots" and f["severity"] == "error"]
            result["named"] = [_named(f) for f in named]
            page = leak["page_size"]
            if errors != {"orphan_slots": leak["count"]}:
                why.append(f"errors {errors}, planted {leak['count']}")
            elif not _listed_first(named[0]["evidence"]["slot_ids"], leak["slot_ids"], page):
                why.append("named slots differ from planted")
            elif "rid " not in named[0]["message"] or not named[0]["evidence"].get("allocated_at"):
                why.append("request or site not named")
    elif case.kind == "row_leak":
        row = planted.get("row-leak")
        named = [f for f in report["findings"] if f["kind"] == "request_rows_leaked"]
        result["named"] = [_named(f) for f in named]
        if not row:
            why.append("no row leak planted")
        elif errors != {"request_rows_leaked": 1}:
            why.append(f"errors {errors}, planted one row")
        elif named[0]["evidence"]["slot_ids"] != row["slot_ids"] or row["rid"] not in str(named[0]["evidence"].get("requests")):
            why.append(f"named {named[0]['evidence'].get('requests')}, planted row {row['slot_ids']} of {row['rid']}")
    elif case.kind == "safety":
        want = {"double_free": planted.get("double-free", {}).get("count"), "stale_last_loc": 1, "index_out_of_range": 2}
        result["named"] = [_named(f) for f in report["findings"] if f["severity"] == "error"]
        if set(planted) != set(case.fault.split(",")):
            why.append(f"planted only {sorted(planted)}")
        if errors != want:
            why.append(f"errors {errors}, want {want}")
        double = next((f for f in report["findings"] if f["kind"] == "double_free"), None)
        if double and planted.get("double-free"):
            page = planted["double-free"]["page_size"]
            if not {s // page for s in double["evidence"]["slot_ids"]} <= {s // page for s in planted["double-free"]["slot_ids"]}:
                why.append("double free: named slots not the planted ones")
        stale = next((f for f in report["findings"] if f["kind"] == "stale_last_loc"), None)
        if stale and planted.get("stale-last-loc"):
            page = planted["stale-last-loc"]["page_size"]
            if planted["stale-last-loc"]["last_loc"] // page not in {s // page for s in stale["evidence"]["slot_ids"]}:
                why.append("stale last_loc: the planted slot's page not named")
        oor = next((f for f in report["findings"] if f["kind"] == "index_out_of_range"), None)
        if oor and oor["evidence"].get("bad_index") != -5:
            why.append(f"out of range: bad index {oor['evidence'].get('bad_index')}, planted -5")
    elif case.kind == "memcheck":
        judge_memcheck(case, result, report, planted, server, why)
    result["verdict"] = "pass" if not why else "FAIL"
    result["why"] = why


def _log_has(server: GpuServer, *words: str) -> bool:
    try:
        with open(server.log_path, errors="replace") as fh:
            text = fh.read()
    except OSError:
        return False
    return all(word in text for word in words)


def judge_memcheck(case: Case, result: dict, report: dict, planted: dict, server: GpuServer, why: list[str]) -> None:
    """Without a fix memcheck sees the write past the KV buffer; with `clamp-last-loc` it sees none.
    Either way kvdoctor names the planted index (a fix does not hide what it fixed)."""
    memcheck = result["memcheck"] = memcheck_read(server.workdir)
    fixed = "clamp-last-loc" in case.env.get("KVDOCTOR_FIXES", "")
    plant = planted.get("index-out-of-range")
    named = [f for f in report.get("findings", []) if f["kind"] == "index_out_of_range"]
    result["named"] = [_named(f) for f in named]
    result["fixes"] = [e["args"] for e in _events(server.trace) if e["name"] == "fix_applied"][:4]
    # SGLang 0.5.23's own KV store kernel asserts its index in range (kvcache.cuh): the write past the
    # buffer stops there, a device-side assert that takes the scheduler down, not a write memcheck sees
    result["sglang_assert"] = _log_has(server, "store_kvcache_kernel", "device-side assert triggered")
    if not plant:
        why.append("no out-of-range last_loc planted")
        return
    if not memcheck["summaries"] and fixed and memcheck["logs"] and not memcheck["errors_reported"]:
        # the suite's stop kills the scheduler before memcheck sums up; what it reports as it finds it stands
        result["memcheck_note"] = "no summary (the stop killed the server's processes); no error reported while they ran"
    elif not memcheck["summaries"]:
        why.append("no memcheck summary (a process killed before memcheck summed up)")
    # the planted last_loc, or the slot the allocator made of it (last_loc + 1), whichever is named first
    if not any(f["evidence"].get("bad_index") in (plant["last_loc"], plant["last_loc"] + 1) for f in named):
        why.append(f"the planted last_loc {plant['last_loc']} is not named: {result['named']}")
    if fixed:
        if memcheck["errors"] or memcheck["invalid_accesses"] or memcheck["errors_reported"]:
            why.append(f"clamp-last-loc on, memcheck still sees {memcheck['errors']} errors: {memcheck['first']}")
        if not result["fixes"]:
            why.append("clamp-last-loc on, no fix_applied recorded")
        if result.get("load", {}).get("failed"):
            why.append(f"requests failed with the fix on: {result['load']['failed']}")
    elif not memcheck["invalid_accesses"] and not result["sglang_assert"]:
        why.append(
            f"no fix, memcheck saw no invalid access (errors {memcheck['errors']}) and SGLang asserted nothing: the case did not test one"
        )


def judge_attach(result: dict, report: dict, errors: dict, planted: dict, trace: str) -> None:
    """Injected, adopted (its books proven against the host's), and each leak named once: the one
    before the attach as leaked before kvdoctor attached, the one after with its request and site."""
    why = result.setdefault("attach_why", [])
    load = result.get("load", {})
    if load.get("attach", {}).get("rc") != 0:
        why.append(f"attach failed: {load.get('attach')}")
        return
    plants = planted.get("leak", {}).get("plants", [])
    result["plants"] = [{k: p.get(k) for k in ("count", "after_attach", "page_size")} for p in plants]
    adopted = [e["args"] for e in _events(trace) if e["name"] == "probe_status" and e["args"].get("adopted")]
    result["adopted"] = adopted[:1]
    if [p["after_attach"] for p in plants] != [False, True]:
        why.append(f"plants {result['plants']}")
        return
    early, late = plants
    if not adopted or not adopted[0].get("verified") or adopted[0].get("held_by_no_one_slots") != early["count"]:
        why.append(f"adoption {adopted[:1]}, planted before {early['count']}")
    named = [f for f in report.get("findings", []) if f["severity"] == "error"]
    result["named"] = [_named(f) for f in named]
    pre = [f for f in named if "before kvdoctor attached" in f["message"]]
    post = [f for f in named if f["kind"] == "orphan_slots" and "before kvdoctor attached" not in f["message"]]
    if len(named) != 2 or len(pre) != 1 or len(post) != 1:
        why.append(f"named {[(f['kind'], f['count']) for f in named]}")
    elif pre[0]["count"] != early["count"] or post[0]["count"] != late["count"] or "rid " not in post[0]["message"]:
        why.append(f"counts {pre[0]['count']}/{post[0]['count']}, planted {early['count']}/{late['count']}")


def _listed_first(named: list[int], planted: list[int], page: int) -> bool:
    """A finding lists the first slots of what it names (64 at most): those must be the planted
    ones' first, page by page (a lost page is named by all its slots)."""
    named_pages = sorted({s // page for s in named})
    planted_pages = sorted({s // page for s in planted})
    return bool(named_pages) and named_pages == planted_pages[: len(named_pages)]


def _named(f: dict) -> dict:
    ev = f.get("evidence", {})
    return {
        "kind": f["kind"],
        "count": f["count"],
        "message": f["message"][:400],
        "slot_ids": (ev.get("slot_ids") or [])[:16],
        "bad_index": ev.get("bad_index"),
        "requests": dict(list((ev.get("requests") or {}).items())[:2]),
        "site": str(ev.get("site", ""))[:300],
        "allocated_at": list(ev.get("allocated_at") or {})[:2],
    }


def bench(server: GpuServer, cpu: bool, workdir: str) -> dict:
    """SGLang's bench_serving: a warm-up pass, then the measured one (fixed lengths, ignore_eos)."""
    n, conc, inp, outp = (24, 8, 64, 32) if cpu else (512, 32, 128, 128)
    args = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--host", "127.0.0.1", "--port", str(server.port)]
    args += ["--model", server.model, "--tokenizer", server.model, "--dataset-name", "random-ids", "--random-range-ratio", "1.0"]
    args += [
        "--random-input-len",
        str(inp),
        "--random-output-len",
        str(outp),
        "--max-concurrency",
        str(conc),
        "--disable-tqdm",
        "--seed",
        "1",
    ]
    env = server._env({})
    out = os.path.join(workdir, "bench.jsonl")
    args += ["--num-prompts", str(n), "--warmup-requests", str(conc * 2), "--output-file", out]  # the warm-up: one burst first
    run = subprocess.run(args, env=env, capture_output=True, text=True, timeout=400, cwd=workdir)
    res: dict = {"rc": run.returncode, "prompts": n, "concurrency": conc, "input_len": inp, "output_len": outp}
    try:
        with open(out) as fh:
            row = json.loads(fh.readlines()[-1])
        for k in (
            "output_throughput",
            "median_itl_ms",
            "p99_itl_ms",
            "median_ttft_ms",
            "p99_ttft_ms",
            "median_tpot_ms",
            "completed",
            "duration",
        ):
            res[k] = row.get(k)
    except (OSError, IndexError, json.JSONDecodeError):
        res["stderr"] = run.stderr[-1500:]
    res["memory"] = memory(server)
    return res


def memory(server: GpuServer) -> dict:
    pid = server.scheduler_pid()
    out: dict = {"scheduler_pid": pid}
    if pid:
        try:
            with open(f"/proc/{pid}/status") as fh:
                out["rss_mib"] = next(int(ln.split()[1]) // 1024 for ln in fh if ln.startswith("VmRSS"))
        except (OSError, StopIteration):
            pass
        try:
            q = subprocess.run(
                ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            for ln in q.stdout.splitlines():
                p, mib = [x.strip() for x in ln.split(",")]
                if int(p) == pid:
                    out["gpu_mib"] = int(mib)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
    return out


def threads_read(workdir: str) -> list[dict]:
    """server_threads/'s last reading of each process that made one: its busiest threads' CPU
    seconds, the native path's counters, and (SUITE_STACKS=1) the main thread's top samples."""
    out = []
    for name in sorted(os.listdir(workdir)):
        if not (name.startswith("threads-") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(workdir, name)) as fh:
                t = json.load(fh)
        except (OSError, ValueError):
            continue
        cpu = sorted(t.get("cpu_s", {}).items(), key=lambda kv: -kv[1])
        samples = sorted(t.get("stack_samples", {}).items(), key=lambda kv: -kv[1])
        row = {"pid": t.get("pid"), "argv": t.get("argv"), "cpu_s": dict(cpu[:8]), "native": t.get("native")}
        if samples:
            row["stack_samples"] = dict(samples[:20])
            row["stack_total"] = sum(v for _, v in samples)
        out.append(row)
    return out


def cost_table(results: dict) -> dict:
    out = {}
    for prefix in ("cost", "cost8b"):
        arms = {}
        names = {m.group(1) for n in results for m in [re.fullmatch(rf"{prefix}-([a-z]+)-\d+", n)] if m}
        for arm in sorted(names):
            rows = [
                r["bench"]
                for n, r in results.items()
                if re.fullmatch(rf"{prefix}-{arm}-\d+", n) and r.get("bench", {}).get("output_throughput")
            ]
            if rows:
                arms[arm] = {
                    k: [r[k] for r in rows] for k in ("output_throughput", "median_itl_ms", "p99_itl_ms", "median_ttft_ms", "p99_ttft_ms")
                }
                arms[arm]["rss_mib"] = [r["memory"].get("rss_mib") for r in rows]
                arms[arm]["gpu_mib"] = [r["memory"].get("gpu_mib") for r in rows]
        if "off" in arms and "on" in arms:
            med = {arm: {k: statistics.median(v) for k, v in arms[arm].items() if v and None not in v} for arm in arms}
            ratios = {
                arm: {k: round(med[arm][k] / med["off"][k], 4) for k in med["off"] if k in med[arm] and med["off"][k]}
                for arm in arms
                if arm != "off"
            }
            out[prefix] = {
                "rounds": {a: len(arms[a]["output_throughput"]) for a in arms},
                "median": med,
                "on_over_off": ratios.get("on", {}),
                "over_off": ratios,
                "all": arms,
            }
    return out


def run(cases: list[Case], out: str, cpu: bool, mem_fraction: str) -> dict:
    # tests/support's clients read the model's vocabulary and tokenizer, and run this python
    sglang_server.MODEL_DIR = os.path.join(CARRY, "model")
    sglang_server.PYTHON = sys.executable
    sglang_server.BASE_FLAGS = []  # the flags are all the case's
    results: dict[str, dict] = {}
    live: dict[str, GpuServer] = {}
    log = open(os.path.join(out, "suite.log"), "a")
    summary_lock = threading.Lock()

    def say(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    def start(case: Case) -> None:
        workdir = os.path.join(out, case.name)
        os.makedirs(workdir, exist_ok=True)
        server = GpuServer(workdir, case, cpu, mem_fraction)
        t0 = time.monotonic()
        results[case.name] = {"case": case.name, "kind": case.kind, "probe": case.probe, "flags": case.flags, "fault": case.fault}
        try:
            server.start()
            live[case.name] = server
            results[case.name]["start_s"] = round(time.monotonic() - t0, 1)
            say(f"{case.name} up in {results[case.name]['start_s']} s")
        except Exception as exc:
            results[case.name].update(verdict="FAIL", why=[f"did not start: {exc}"[:3000]])
            say(f"{case.name} did not start: {str(exc)[-1500:]}")

    def finish(case: Case, work) -> None:
        server = live.get(case.name)
        if server is None:
            return
        r = results[case.name]
        try:
            work(server, r)
        except Exception:
            r.update(verdict="FAIL", why=[traceback.format_exc()[-2000:]])
        finally:
            r["stop_rc"] = server.stop()
            r["log_tail"] = server.log_tail(1500) if r.get("verdict") == "FAIL" else ""
            r["threads"] = threads_read(server.workdir)
        if r.get("verdict") != "FAIL":
            try:
                if case.kind != "cost":
                    judge(case, r, server)
                elif case.probe:
                    c = censuses(server.trace)
                    r["census"] = c
                    if not c["censuses"] or c["unbalanced_count"]:
                        r.update(verdict="FAIL", why=[f"censuses {c['censuses']}, unbalanced {c['unbalanced_count']}"])
            except Exception:
                r.update(verdict="FAIL", why=[traceback.format_exc()[-2000:]])
        r.setdefault("verdict", "pass" if r.get("bench", {}).get("output_throughput") else "FAIL")
        with summary_lock:
            write_summary(out, results, cpu)
        say(
            f"{case.name}: {r.get('verdict')} {r.get('why', '')} {r.get('errors', '')} {json.dumps(r.get('bench', {}).get('output_throughput'))}"
        )

    alone = [c for c in cases if c.alone]  # 77 GB each at --mem-fraction-static 0.7: two do not fit
    cases = [c for c in cases if not c.alone] or alone[:1]
    alone = [c for c in alone if c not in cases]
    start(cases[0])  # alone: the JIT kernels and caches it makes serve the others
    if cases[0].probe and cases[0].name in live and not probe_on(live[cases[0].name].trace):
        results[cases[0].name].update(verdict="FAIL", why=["the probe did not come up in the scheduler"])
        live.pop(cases[0].name).stop()
    if cases[0].name not in live:  # what stops the first stops them all: say so, spend no more
        for c in cases[1:]:
            results[c.name] = {"case": c.name, "kind": c.kind, "verdict": "not run", "why": [f"{cases[0].name} did not start"]}
        return results
    threads = [threading.Thread(target=start, args=(c,)) for c in cases[1:]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    def correctness(server: GpuServer, r: dict) -> None:
        kind = server.case.kind
        drivers = {
            "hicache": drive_hicache,
            "hicache_l3": drive_hicache_l3,
            "attach": drive_attach,
            "memcheck": drive_memcheck,
            "pd_decode": drive_pd_decode,
        }
        r["load"] = drivers.get(kind, drive)(server, cpu)

    threads = [threading.Thread(target=finish, args=(c, correctness)) for c in cases if c.kind != "cost"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    def cost(server: GpuServer, r: dict) -> None:
        r["bench"] = bench(server, cpu, server.workdir)

    for c in [c for c in cases if c.kind == "cost"]:  # one at a time, in the order given
        finish(c, cost)
    for c in alone:
        start(c)
        finish(c, cost)
    return results


def write_summary(out: str, results: dict, cpu: bool) -> dict:
    """Written after every case, so that a run stopped at its limit leaves what it finished."""
    cost = cost_table(results)
    done = {n: r for n, r in results.items() if "verdict" in r}
    summary = {"cases": done, "cost": cost, "cpu_dry_run": cpu, "passed": bool(done) and all(r["verdict"] == "pass" for r in done.values())}
    with open(os.path.join(out, "summary.json.tmp"), "w") as fh:
        json.dump(summary, fh, indent=1)
    os.replace(os.path.join(out, "summary.json.tmp"), os.path.join(out, "summary.json"))
    with open(os.path.join(out, "summary.md"), "w") as fh:
        fh.write(summary_md(done, cost))
    copy_to = os.environ.get("SUITE_COPY_TO")  # the device's $OUT: what comes back even when the call runs out of time
    if copy_to and os.path.isdir(copy_to):
        for name in ("summary.json", "summary.md"):
            with open(os.path.join(out, name), "rb") as src, open(os.path.join(copy_to, name), "wb") as dst:
                dst.write(src.read())
    return summary


def summary_md(results: dict, cost: dict) -> str:
    lines = ["| case | verdict | errors | censuses (idle) | unbalanced | notes |", "| --- | --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        c = r.get("census", {})
        note = "; ".join(str(w)[:120] for w in r.get("why", []))
        if r.get("bench", {}).get("output_throughput"):
            b = r["bench"]
            note = f"{b['output_throughput']:.0f} tok/s, ITL {b['median_itl_ms']:.2f}/{b['p99_itl_ms']:.2f} ms " + note
        if r.get("named"):
            note += " named: " + "; ".join(f"{n['kind']} x{n['count']}" for n in r["named"])
        lines.append(
            f"| {name} | {r.get('verdict')} | {r.get('errors', '')} | {c.get('censuses', '')} ({c.get('idle_censuses', '')}) | {c.get('unbalanced_count', '')} | {note} |"
        )
    for prefix, t in cost.items():
        lines.append("")
        lines.append(
            f"{prefix}: rounds {t['rounds']}, over off (medians): "
            + "; ".join(f"{arm}: " + ", ".join(f"{k} {v}x" for k, v in r.items()) for arm, r in t.get("over_off", {}).items())
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="clean-p1,clean-p16,clean-noradix,clean-chunked,fault-leak,fault-safety")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--mem-fraction", default="0.3")
    a = ap.parse_args()
    names = [n for n in a.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"unknown case(s): {', '.join(unknown)}; known: {', '.join(CASES)}", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    results = run([CASES[n] for n in names], a.out, a.cpu, a.mem_fraction)
    summary = write_summary(a.out, results, a.cpu)
    print(summary_md(summary["cases"], summary["cost"]))
    return 0 if summary["passed"] and len(summary["cases"]) == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
