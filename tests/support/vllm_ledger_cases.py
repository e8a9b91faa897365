"""Drives vLLM's real `BlockPool` (no server, no model) with the probe on, one case at a time, each
ending with the exit census; the test replays each trace. Run with .venv-vllm's Python:

    python tests/support/vllm_ledger_cases.py CASE TRACE
    python tests/support/vllm_ledger_cases.py CASE,CASE,... TRACE_DIR    (TRACE_DIR/CASE.kvtrace.json)

One RESULT line per case. Several cases share one interpreter (vLLM is imported once), each under a
probe of its own. Cases: clean (alloc, prefix-cache touch, frees through a one-shot iterator),
double_free, double_alloc (a block put back on vLLM's free queue behind the pool's back), leak
(blocks never freed), unhooked (vLLM's ref_cnt changed by a path kvdoctor does not hook), late (a
pool in use before the probe came: a request's blocks freed after it, blocks lost before it, a leak
after it; alone in its interpreter, as its pool is used before any probe).
"""

import json
import os
import sys


def run(case: str, trace: str) -> dict:
    if case == "late":  # the probe comes after the pool has served (attach): adopted, not accused
        from vllm.v1.core.block_pool import BlockPool

        early = BlockPool(num_gpu_blocks=64, enable_caching=True, hash_block_size=16)
        held = early.get_new_blocks(4)  # a request still running when the probe comes
        early.touch(held[:1])  # ... one block shared with another
        lost = early.get_new_blocks(3)  # blocks a path forgot before the probe came: never named

    from kvdoctor.probe.core import runtime

    probe = runtime.activate(trace)

    from vllm.v1.core.block_pool import BlockPool  # imported after the probe: hooked

    from kvdoctor.probe.engines.vllm import roles as vllm_roles

    pool = BlockPool(num_gpu_blocks=64, enable_caching=True, hash_block_size=16)
    out = {"case": case}

    a = pool.get_new_blocks(4)
    pool.touch(a[:2])  # a prefix-cache hit shares two of them
    pool.free_blocks(reversed(a))  # one-shot iterator, as vLLM's own callers pass it
    pool.free_blocks(iter(a[:2]))  # the sharer lets go

    if case == "double_free":
        b = pool.get_new_blocks(3)
        pool.free_blocks(b)
        pool.free_blocks(b[1:2])  # vLLM does not check: its ref_cnt goes to -1
        out["block_ids"] = [b[1].block_id]
    elif case == "double_alloc":
        b = pool.get_new_blocks(1)[0]
        b.ref_cnt = 0  # an unhooked path "frees" it while it is still in use ...
        pool.free_block_queue.append(b)
        rest = pool.get_new_blocks(pool.get_num_free_blocks())  # ... and it is handed out again
        out["block_ids"] = [b.block_id]
        pool.free_blocks(rest)
    elif case == "leak":
        b = pool.get_new_blocks(5)
        pool.free_blocks(b[:2])
        out["block_ids"] = sorted(x.block_id for x in b[2:])
    elif case == "unhooked":
        b = pool.get_new_blocks(2)
        b[0].ref_cnt += 1  # vLLM's count moves, the ledger never hears of it
        pool.free_blocks(b)
        out["block_ids"] = [b[0].block_id]
    elif case == "late":
        early.free_blocks(held[:1])  # the sharer finishes ...
        early.free_blocks(reversed(held))  # ... then the request running at the attach: no double free
        after = early.get_new_blocks(2)  # a leak after the probe came: named
        out["block_ids"] = sorted(x.block_id for x in after)
        out["lost_before"] = sorted(x.block_id for x in lost)

    vllm_roles.state(probe).exit_census()
    out["hooked_calls"] = probe.calls
    out["ledger_on"] = probe.ledger_on
    runtime.deactivate()
    return out


def main() -> None:
    cases, where = sys.argv[1].split(","), sys.argv[2]
    if len(cases) > 1 and "late" in cases:
        sys.exit("the late case runs alone: its pool is used before any probe")
    for case in cases:
        trace = os.path.join(where, f"{case}.kvtrace.json") if len(cases) > 1 else where
        print("RESULT " + json.dumps(run(case, trace)), flush=True)


if __name__ == "__main__":
    main()
