"""The Mamba state column vLLM's V2 model runner seeds for a request, judged before a kernel reads it.

With "align" prefix caching (`cache_config.mamba_cache_mode == "align"`) a hybrid model's mamba
state is kept once per `cache_config.mamba_block_size` tokens, one column of the request's mamba
block table per mamba block. `MambaHybridModelState.add_request(req_index, new_req_data)`
(vllm/v1/worker/gpu/model_states/mamba_hybrid.py) seeds `_mamba_state_idx_gpu[req_index]` with the
column that holds the state after the request's computed tokens; the next step's
`preprocess_mamba_align_fused_kernel` takes it as the source column, and the pre-copy kernel reads
the request's mamba block-table row there. vLLM 0.28-0.31 divide by `cache_config.block_size`, the
attention block size (the smallest over the prefix-cacheable groups), so where that is smaller than
`mamba_block_size` the column lands past the request's mamba blocks: an out-of-bounds read on the
GPU (vllm#55600). 0.32 divides by `mamba_block_size` (PR#55601).

After each `add_request` in align mode the probe reads the value vLLM seeded: from a CPU tensor at
once; from a CUDA tensor through a pinned copy behind an event (`ledger.arrays`), judged at a later
call or on the writer thread's round once the copy is done, so the host never waits (at exit the
copies still in flight are waited for). `n` computed tokens fill ceil(n / mamba_block_size) mamba
blocks, columns 0 .. ceil(n / mamba_block_size) - 1; -1 is legal only with nothing computed (a
fresh state). Any other value is an `index_out_of_range` violation naming the request, n, both
block sizes, the column and the bound, the lengths of the request's block-id lists per KV cache
group, and the call site. Outside align mode nothing is read. Anything not laid out as read here
turns this check off (said once); the server's calls and the other ledgers go on.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from kvdoctor.probe.base.context import Args, Hook, Kwargs, Role
from kvdoctor.probe.base.objects import own
from kvdoctor.probe.ledgers.arrays import ReadyRead, arrays_for
from kvdoctor.trace import schema

if TYPE_CHECKING:
    from kvdoctor.probe.base.context import ProbeContext

LEDGER = "vllm_mamba_index"
WHAT = "the vLLM Mamba state column check"
MAX_PENDING = 1024  # seeded columns whose device copy is still in flight; past it, counted as not judged
NOTE = (
    "the column the next step's preprocess_mamba_align_fused_kernel takes as the request's source column; "
    "the pre-copy kernel reads the request's mamba block-table row there, past its mamba blocks (on a GPU an "
    "out-of-bounds read). vllm#55600: vLLM 0.28-0.31 seed it as (num_computed_tokens - 1) // "
    "cache_config.block_size, the attention block size; 0.32 divides by cache_config.mamba_block_size (PR#55601)"
)


class NotUnderstood(Exception):
    """The model state or the request is not laid out as this check reads it."""


def _int(value: Any, what: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise NotUnderstood(f"{what} is {type(value).__name__}, not an int")


class MambaIndexLedger:
    """Per process: the seeded columns whose device copy is still in flight, and the counts."""

    def __init__(self, probe: ProbeContext | None = None) -> None:
        self.lock = threading.Lock()
        self.pending: list[tuple[Any, dict[str, Any]]] = []  # (read in flight, evidence)
        self.judged = 0
        self.bad = 0
        self.not_judged = 0  # in flight past MAX_PENDING
        self.said_on = False

    def after_add(self, probe: ProbeContext, model_state: Any, req_index: Any, new_req_data: Any, site: int) -> None:
        cache_config = own(model_state, "cache_config")
        if cache_config is None:
            raise NotUnderstood(f"{type(model_state).__name__} has no cache_config")
        if own(model_state, "_align_mode") is not True:
            return  # not align mode: no column is seeded
        seeded = own(model_state, "_mamba_state_idx_gpu")
        index = _int(req_index, "req_index")
        if seeded is None or not hasattr(seeded, "device") or not 0 <= index < int(seeded.shape[0]):
            raise NotUnderstood(f"_mamba_state_idx_gpu is {type(seeded).__name__} without a row {index}")
        mamba_block_size = _int(own(cache_config, "mamba_block_size"), "cache_config.mamba_block_size")
        if mamba_block_size <= 0:
            raise NotUnderstood(f"cache_config.mamba_block_size is {mamba_block_size}")
        block_ids = own(new_req_data, "block_ids")
        evidence = {
            "request": str(own(new_req_data, "req_id")),
            "req_index": index,
            "num_computed_tokens": _int(own(new_req_data, "num_computed_tokens"), "new_req_data.num_computed_tokens"),
            "block_size": own(cache_config, "block_size"),
            "mamba_block_size": mamba_block_size,
            "block_ids_per_group": [len(ids) for ids in block_ids] if isinstance(block_ids, (list, tuple)) else None,
            "site": probe.sites.name(site),
            "allocator": type(model_state).__name__,
            "device": str(seeded.device),
        }
        row = seeded[index : index + 1]
        if str(seeded.device) == "cpu":
            read: Any = ReadyRead([row.numpy().copy()])  # read at the call: no device to wait for
        else:
            read = arrays_for(seeded.device).snapshot([row])  # a pinned copy behind an event
        if not self.said_on:
            self.said_on = True
            probe.emitter.emit(
                schema.PROBE_STATUS,
                {
                    "component": "ledger",
                    "state": "on",
                    "ledger": LEDGER,
                    "reason": f"{WHAT} for {type(model_state).__name__} (align mode, mamba_block_size "
                    f"{mamba_block_size}, block_size {evidence['block_size']}, {evidence['device']})",
                },
            )
        with self.lock:
            self.pending.append((read, evidence))
        self.drain(probe)

    def drain(self, probe: ProbeContext, *, wait: bool = False) -> None:
        """Judges the seeded columns whose copy is done (all of them with `wait`: at exit only)."""
        with self.lock:
            done: list[tuple[Any, dict[str, Any]]] = []
            kept: list[tuple[Any, dict[str, Any]]] = []
            for read, evidence in self.pending:
                if wait:
                    read.wait()
                (done if read.ready() else kept).append((read, evidence))
            if len(kept) > MAX_PENDING:
                self.not_judged += len(kept) - MAX_PENDING
                kept = kept[-MAX_PENDING:]
            self.pending = kept
        for read, evidence in done:
            self.judge(probe, int(read.get()[0].reshape(-1)[0]), evidence)

    def judge(self, probe: ProbeContext, column: int, evidence: dict[str, Any]) -> None:
        n = evidence["num_computed_tokens"]
        mamba_block_size = evidence["mamba_block_size"]
        blocks = -(-n // mamba_block_size) if n > 0 else 0  # the mamba blocks n computed tokens fill
        self.judged += 1
        if (n <= 0 and column == -1) or 0 <= column < blocks:
            return
        self.bad += 1
        probe.emitter.emit(
            schema.VIOLATION,
            {
                "kind": schema.INDEX_OUT_OF_RANGE,
                "count": 1,
                **evidence,
                "mamba_state_column": column,
                "mamba_blocks_computed": blocks,
                "valid_columns": [0, blocks - 1] if blocks else [-1, -1],
                "requests": {evidence["request"]: 1},
                "note": NOTE,
            },
        )

    def periodic(self, probe: ProbeContext) -> None:
        if self.pending and probe.ledger_is_on(LEDGER):
            try:
                self.drain(probe)
            except Exception as exc:
                turn_off(probe, exc)

    def close(self, probe: ProbeContext, reason: str) -> None:
        if not probe.ledger_is_on(LEDGER):
            return
        try:
            self.drain(probe, wait=True)  # at exit: a wait harms no one
        except Exception as exc:
            turn_off(probe, exc)
            return
        if self.not_judged:
            probe.emitter.emit(
                schema.PROBE_STATUS,
                {
                    "component": "ledger",
                    "state": "partial",
                    "ledger": LEDGER,
                    "reason": f"{WHAT}: {self.not_judged} seeded column(s) not judged (more than {MAX_PENDING} device copies in flight)",
                },
            )


def state(probe: ProbeContext) -> MambaIndexLedger:
    return probe.state(LEDGER, MambaIndexLedger)


def turn_off(probe: ProbeContext, exc: BaseException) -> None:
    probe.turn_off_ledger(LEDGER, WHAT, f"Mamba state columns not judged: {type(exc).__name__}: {exc}")


class SeedRole(Role):
    """`MambaHybridModelState.add_request(req_index, new_req_data)`: the seeded column, judged."""

    ledger = LEDGER
    wants_site = True
    reads = {"req_index": 0, "new_req_data": 1}

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        try:
            state(probe).after_add(probe, obj, hook.arg(args, kwargs, "req_index"), hook.arg(args, kwargs, "new_req_data"), ctx)
        except Exception as exc:
            turn_off(probe, exc)


ROLES: dict[str, Role] = {"vllm_mamba_seed": SeedRole()}
