"""On a GPU: SGLang's own prefill row writer under the probe, its real Triton kernel included.

SGLang's `write_cache_indices` (0.5.23: mem_cache/allocation.py) writes each prefill batch's request
rows with the Triton kernel `write_req_to_token_pool_triton` wherever the attention backend supports
Triton, calling no pool method; the probe's role `req_write_extend` gives the slot ledger those
rows' owners, worked out on the device. This runs tests/support/prefill_batches.py's two batches
(the first finished into the real `RadixCache`, the second sharing its prefixes and left live) on
CUDA tensors with the `triton` attention backend, each page size (1, 16) in a fresh process, and
checks:
- no GPU->CPU synchronisation: the role's work runs under `torch.cuda.set_sync_debug_mode("error")`,
  and on 0.5.23 the whole `write_cache_indices` call does too (its Triton branch copies the prefix
  pointers from pinned memory without blocking; 0.5.9's copies them from pageable memory, a
  synchronisation of SGLang's own, so there only the role's work runs under it);
- the device ledger's owners against `req_to_token`, read back after the prefills: 0 mismatches;
- the rolling censuses taken while the second batch is live: 0 orphan slots.
Prints one JSON line (also written to --out); exits 0 when every check holds, 1 when one does not.

    python3 bench/gpu/prefill_rows.py [--out FILE] [--trace-dir DIR]   # the GPU machine, repository root
    python3 bench/gpu/prefill_rows.py --cpu                            # a dry run of the harness

`--cpu` is a check of the harness, not a result: the kernel is stood in (the torch loop
`WriteReqToTokenPoolStandIn`), the ledger takes its GPU (torch) path on CPU tensors, and there is no
synchronisation to detect.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUPPORT = os.path.join(REPO, "tests", "support")
PAGE_SIZES = (1, 16)
SITE = "/tmp/site"  # where bench/gpu/run_all.sh installs the carried wheels


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="dry run on CPU: the kernel stood in, no sync check")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--trace-dir", help="keep the probe's traces here (a temporary folder otherwise)")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # one page size, in this process
    parser.add_argument("--trace", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        return run_one(args.one, args.cpu, args.trace)
    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="prefill_rows-")
    os.makedirs(trace_dir, exist_ok=True)
    env = {**os.environ, "KVDOCTOR_ROLLING_CENSUS_S": "0.2", "PYTHONWARNINGS": "ignore"}
    # the repository first; tests/support (prefill_batches, and the import-only sgl_kernel that SGLang
    # needs where the real one is not installed) after what the caller put there
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, *sglang_path(), os.environ.get("PYTHONPATH", ""), SUPPORT) if p)
    cases = []
    for page_size in PAGE_SIZES:
        trace = os.path.join(trace_dir, f"prefill_rows-{page_size}.kvtrace.json")
        command = [sys.executable, os.path.abspath(__file__), "--one", str(page_size), "--trace", trace] + (["--cpu"] if args.cpu else [])
        proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if lines:
            cases.append(json.loads(lines[-1][len("RESULT ") :]))
        else:
            cases.append({"page_size": page_size, "ok": False, "rc": proc.returncode, "stderr_tail": proc.stderr[-2000:]})
    summary = {
        "check": "prefill_rows",
        "dry_run_cpu": args.cpu,
        "ok": all(case.get("ok") for case in cases),
        "mismatches": sum(case.get("owner_mismatches", 0) for case in cases),
        "orphans": sum(max(0, case.get("max_live_orphan_slots", 0)) for case in cases),
        "traces": trace_dir,
        "cases": cases,
    }
    line = json.dumps(summary)
    print(line, flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(line + "\n")
    return 0 if summary["ok"] else 1


def sglang_path() -> list[str]:
    """Where SGLang comes from: the environment's own, else the wheels carried in .whl/
    (bench/gpu/README.md), installed into SITE as run_all.sh installs them."""
    if importlib.util.find_spec("sglang") is not None:
        return []
    if not os.path.isdir(os.path.join(SITE, "sglang")):
        wheels = sorted(glob.glob(os.path.join(REPO, ".whl", "*.whl")))
        if not wheels:
            raise SystemExit("prefill_rows: SGLang does not import here and .whl/ holds no wheels: carry them as bench/gpu/README.md says")
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade"]
        subprocess.run([*pip, "--target", SITE, *wheels], check=True)
    return [SITE]


def run_one(page_size: int, cpu: bool, trace: str) -> int:
    """One page size: the probe, SGLang's pools on the device, two prefill batches, the checks."""
    import torch

    if not cpu and not torch.cuda.is_available():
        print("prefill_rows: no CUDA device here; run with --cpu for a dry run of the harness", file=sys.stderr)
        return 2
    device = "cpu" if cpu else "cuda"
    from kvdoctor.probe.engines.sglang.prefill import ReqWriteExtendRole

    role_syncs: list[str] = []
    ReqWriteExtendRole.after = sync_checked(ReqWriteExtendRole.after, cpu, role_syncs)  # before the probe binds it
    if cpu:  # the GPU ledger's torch path, on CPU tensors
        from kvdoctor.probe.ledgers import arrays, slots

        slots.arrays_for = lambda _device: arrays.DeviceArrays("cpu")
    from kvdoctor.probe.core import runtime

    probe = runtime.activate(trace)
    from prefill_batches import PrefillBatches, live_censuses, ownership

    from kvdoctor.probe.engines.sglang.state import sglang_state

    batches = PrefillBatches(page_size, device, "torch_native" if cpu else "triton")
    stand_in = batches.stand_in_for_the_kernel() if cpu else None
    hooked_writer = batches.writer.write_cache_indices
    sglang_syncs: list[str] = []
    whole_call = batches.layout == "0.5.23"
    if whole_call:  # alloc_for_extend looks the writer up in its module
        batches.writer.write_cache_indices = sync_checked(hooked_writer, cpu, sglang_syncs)
    try:
        second = batches.run_two_batches()
    except RuntimeError as exc:  # a synchronisation in SGLang's own writer (the role's are caught inside)
        sglang_syncs.append(str(exc).splitlines()[0][:300])
        second = []
    if not cpu:
        torch.cuda.synchronize()
    prefilled = time.monotonic()
    state = sglang_state(probe)
    ledger = state.ledgers.get(id(batches.allocator))
    result = ownership(ledger, batches, second) if ledger is not None and second else {}
    live = live_censuses(state, prefilled, len(second)) if second else []
    if second:
        batches.finish(second)
    runtime.deactivate()
    import sglang

    orphans = max((c["orphan_slots"] for c in live), default=-1)
    out = {
        "page_size": page_size,
        "sglang": getattr(sglang, "__version__", "?"),
        "layout": batches.layout,
        "device": torch.cuda.get_device_name() if not cpu else "cpu (dry run)",
        "torch": torch.__version__,
        "hooked": getattr(hooked_writer, "__kvdoctor_role__", None),
        "kernel": f"stood in ({stand_in.launches} launches)" if stand_in else "write_req_to_token_pool_triton (SGLang's)",
        "ledger_kernels": ledger is not None and ledger.kernels is not None,
        "sync_debug": "off (cpu)" if cpu else ("error over write_cache_indices" if whole_call else "error over the role's work"),
        "role_syncs": role_syncs,
        "sglang_syncs": sglang_syncs,
        "probe_failures": probe.failures,
        **result,
        "live_censuses": len(live),
        "max_live_orphan_slots": orphans,
        "sglang_unaccounted": batches.unaccounted(),
    }
    out["ok"] = bool(
        out["hooked"] == "req_write_extend"
        and result.get("owner_mismatches") == 0
        and result.get("prefix_not_tree") == 0
        and result.get("owned_pages") == result.get("expected_owned_pages", -1) > 0
        and len(live) >= 2
        and orphans == 0
        and not role_syncs
        and not sglang_syncs
        and probe.failures == 0
        and out["sglang_unaccounted"] == 0
    )
    print("RESULT " + json.dumps(out), flush=True)
    return 0 if out["ok"] else 1


def sync_checked(function, cpu: bool, caught: list[str]):  # type: ignore[no-untyped-def]
    """`function` run with any GPU->CPU synchronisation an error (torch's sync debug mode), each one
    also noted in `caught` (the probe swallows an error in a role); as it is on CPU, where there is
    nothing to detect."""
    import functools

    import torch

    @functools.wraps(function)
    def checked(*args, **kwargs):  # type: ignore[no-untyped-def]
        if cpu:
            return function(*args, **kwargs)
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return function(*args, **kwargs)
        except RuntimeError as exc:
            caught.append(str(exc).splitlines()[0][:300])
            raise
        finally:
            torch.cuda.set_sync_debug_mode(previous)

    return checked


if __name__ == "__main__":
    sys.exit(main())
