"""On the GPU machine: the vLLM Mamba state column check's device read (kvdoctor/probe/engines/vllm/
mamba_index.py) on a CUDA tensor, without vLLM. vLLM's V2 runner needs Triton and a GPU wheel, so
the real `MambaHybridModelState` runs on CPU only (tests/integration/test_vllm_mamba_index.py);
here the model state is a plain object carrying what `add_request` leaves: a CUDA int32
`_mamba_state_idx_gpu` whose row was just filled on the current stream, behind a
`torch.cuda._sleep` so that the value is still in flight when the probe looks.

Checks: the probe's `after_add` runs under `torch.cuda.set_sync_debug_mode("error")` (no
synchronizing call); right after it nothing is judged and the copy is pending; once the stream is
done, the writer thread's round (`periodic`) judges it: column 7 for 128 computed tokens at mamba
blocks of 64 named as `index_out_of_range`, column 1 silent. Prints one JSON line; exit 1 on any
failure.

    PYTHONPATH=. python3 bench/gpu/mamba_index_check.py
"""

from __future__ import annotations

import json
import sys

import torch

from kvdoctor.probe.core.runtime import Probe
from kvdoctor.probe.engines.vllm import mamba_index
from kvdoctor.trace import schema


class Obj:
    def __init__(self, **attrs) -> None:
        self.__dict__.update(attrs)


def main() -> int:
    probe = Probe(None)
    events: list[schema.Event] = []
    probe.emitter.listeners.append(events.append)
    seeded = torch.zeros(4, dtype=torch.int32, device="cuda")
    state = Obj(cache_config=Obj(block_size=16, mamba_block_size=64), _align_mode=True, _mamba_state_idx_gpu=seeded)
    st = mamba_index.state(probe)
    out: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for req_index, (rid, column) in enumerate((("bad-0", 7), ("good-1", 1))):
            torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU time ahead of the fill: the value is in flight
            seeded[req_index].fill_(column)  # as vLLM's add_request does, on the current stream
            st.after_add(probe, state, req_index, Obj(req_id=rid, num_computed_tokens=128, block_ids=([1] * 13, [9] * 4)), 0)
        out["pending_right_after"] = len(st.pending)
        out["violations_right_after"] = sum(e.name == schema.VIOLATION for e in events)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    st.periodic(probe)
    bad = [e.args for e in events if e.name == schema.VIOLATION]
    out.update(
        pending_after=len(st.pending),
        judged=st.judged,
        named=[(v["request"], v["mamba_state_column"], v["valid_columns"], v["device"]) for v in bad],
        ledger_on=probe.ledger_is_on(mamba_index.LEDGER),
    )
    ok = (
        out["pending_right_after"] == 2
        and out["violations_right_after"] == 0
        and out["pending_after"] == 0
        and out["judged"] == 2
        and out["named"] == [("bad-0", 7, [0, 1], "cuda:0")]
        and out["ledger_on"]
    )
    out["ok"] = ok
    print(json.dumps(out))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
