"""The trace schema: the one format every probe writes and every detector reads.

A trace is a Trace Event Format file in its "JSON array" form, one event per line:

    [
    {"ph":"M","name":"kvdoctor_header","pid":...,"args":{"schema":"kvdoctor.trace/1",...}},
    {"ph":"C","name":"kv_slots","pid":...,"ts":...,"args":{...}},
    ...

The closing bracket is optional in that format, so a trace cut off by a crash still opens in
Perfetto and chrome://tracing, and our reader loses at most the last partial line. Every process
that writes into a trace first writes its own header event; detectors key everything by pid.
"""

from __future__ import annotations

import dataclasses
from typing import Any

SCHEMA_NAME = "kvdoctor.trace"
SCHEMA_VERSION = 1
SCHEMA_ID = f"{SCHEMA_NAME}/{SCHEMA_VERSION}"
# PROBE_STATUS's component by which an engine's process says it is starting (state "starting", once
# its engine is found) and that it took its first request (state "on"; kvdoctor.analysis.serving_start)
SERVING = "serving"
SERVING_ENGINES = ("sglang", "vllm")  # the serving engines kvdoctor probes: what a header's `engine` names

# Event names (the `name` field) that carry meaning for detectors.
HEADER = "kvdoctor_header"  # ph M: schema, engine, engine_version, pid, process_title
RUN_HEADER = "kvdoctor_run"  # ph M: written by `kvdoctor run`/`watch` for the whole trace
TRACE_END = "kvdoctor_end"  # ph M: a clean end of the trace
PROCESS_NAME = "process_name"  # ph M: Perfetto's own name for a pid's track
VIOLATION = "violation"  # ph i: a ledger rule broken at a hooked call (kind in args)
CENSUS = "census"  # ph i: an idle/exit count of every slot's state
PROBE_STATUS = "probe_status"  # ph i: probe enabled/disabled/partial, and why
LEDGER_COUNTER = "kv_slots"  # ph C: free/owned/tree slot counts of one allocator
MEMORY_COUNTER = "memory"  # ph C: one process's memory by class, in bytes
MEMORY_CLASSES = "memory_classes"  # ph C: the probe's split of anon memory: Python heap, malloc heap, pinned cache, native
PROBE_STATS = "probe_stats"  # ph C: hooked calls, dropped events, probe memory
HICACHE_COUNTER = "hicache"  # ph C: HiCache host ledger, controller queues, storage traffic
RETAINED_VIEWS = "retained_views"  # ph i: host-index views kept alive by the tree (sglang#19332)
L3_COUNTER = "l3_store"  # ph C: HiCache L3 store ledger: pages set/got, keys written/read/never read, bytes
L3_KEYS = "l3_keys"  # ph i: the L3 ledger's summary with sample keys (periodic when changed, and at exit)
HOST_GROWTH_SITES = "host_growth_sites"  # ph i: one attribution window: where host memory grew
FINDING = "finding"  # ph i: a finding the analysis made (written by watch/run)
FIX_APPLIED = "fix_applied"  # ph i: an optional fix changed the host's behaviour
CONNECTOR_OVERDUE = "connector_overdue"  # ph i: a KV connector has held a finished request's blocks past the deadline
CONNECTOR_LATE_RELEASE = "connector_late_release"  # ph i: an overdue connector hold ended at last
CONTAINER_SIZES = "container_sizes"  # ph i: len() of the engine's containers reachable from a hooked object, by path
MAMBA_POOL = "mamba_pool"  # ph i: a Mamba pool's census: free, tree, rows, waiting and running holders, unaccounted (when changed)
METADATA_POOL = "metadata_pool"  # ph i: a PD metadata row allocator's census: free, held, leaked, judged (when changed, and at exit)
LORA_POOL = "lora_pool"  # ph i: a LoRA memory pool's uids vs the adapters loaded (at load/unload when changed, and at exit)
PD_TRANSFERS = "pd_transfers"  # ph i: PD decode's transfer queue: requests by KVPoll state, the oldest with their age (when changed)
PD_TRANSFER = "pd_transfer"  # ph i: one PD decode transfer's abort or release, with its state and age
MM_INPUTS = (
    "mm_inputs"  # ph i: finished requests whose multimodal feature tensors are still alive: rid, bytes, device (when changed, and at exit)
)

# The counters a trace carries, one row per event when exported as a table.
COUNTER_NAMES = frozenset({LEDGER_COUNTER, MEMORY_COUNTER, MEMORY_CLASSES, HICACHE_COUNTER, L3_COUNTER, PROBE_STATS})

# The call site given to slots that were in use, held by no request or tree node, when the probe
# adopted an allocator's state late (attach): they leaked before it arrived.
SITE_BEFORE_ATTACH = "before kvdoctor attached"
OWNER_BEFORE_ATTACH = "no request or tree node when kvdoctor attached (leaked before attach)"  # ... and their owner
# ... and of slots held then whose holder the adoption could not prove (its books did not add up)
SITE_HELD_AT_ATTACH = "held when kvdoctor attached (not proven)"
HOLDER_AT_ATTACH = "a holder from before kvdoctor attached (not read)"  # a vLLM block's references then

CAT_PROBE = "kvdoctor.probe"
CAT_SAMPLER = "kvdoctor.sampler"
CAT_ANALYSIS = "kvdoctor.analysis"

# Violation kinds the probe's ledgers raise (`kind` in a VIOLATION event); each is also the kind
# of the finding its detector makes.
DOUBLE_FREE = "double_free"
DOUBLE_ALLOC = "double_alloc"
ORPHAN_SLOTS = "orphan_slots"
STALE_LAST_LOC = "stale_last_loc"
INDEX_OUT_OF_RANGE = "index_out_of_range"
USE_AFTER_FREE = "use_after_free"
TREE_HOLDS_FREE_SLOT = "tree_holds_free_slot"
LOCK_UNDERFLOW = "lock_ref_underflow"
GRAPH_REPLAY_DURING_LOAD = "graph_replay_during_load"
REFCOUNT_DISAGREES = "refcount_disagrees"
MAMBA_ORPHAN_SLOTS = "mamba_orphan_slots"  # Mamba state slots held by no request, row or tree node
LORA_GHOST_UID = "lora_ghost_uid"  # an unloaded LoRA adapter's uid still holds a buffer slot of the pool
SWA_SLOT_FREED_LIVE = "swa_slot_freed_live"  # a deferred SWA free took a live SWA slot its full slot was re-pointed at
PD_TRANSFER_FREED_IN_FLIGHT = "pd_transfer_freed_in_flight"  # PD decode pages freed while the prefill may still write them
PD_TRANSFER_STUCK = "pd_transfer_stuck"  # a PD decode transfer in WaitingForInput/Transferring past the deadline
METADATA_DOUBLE_FREE = "metadata_double_free"  # a PD metadata buffer row index freed while already free
METADATA_INDEX_OUT_OF_RANGE = "metadata_index_out_of_range"  # a PD metadata buffer row index freed outside the pool
METADATA_ROWS_LEAKED = "metadata_rows_leaked"  # PD metadata buffer rows held by no live request
REQUEST_ROWS_LEAKED = "request_rows_leaked"  # request pool rows whose request is gone, no free of them seen

# A slot ledger's flight recorder (kvdoctor/probe/ledgers/history.py): a violation or census naming
# pages carries, under SLOT_HISTORY, a list of {page, first_slot, page_size, entries}, each entry
# {op (one of HISTORY_OPS), site, row (int, None or the owner's sentence), seq, thread, ago_ms, and
# rid: the request the row served when the entry was written, where the probe saw it take the row},
# oldest first; where the ledger keeps none, HISTORY_OFF says why; a census whose orphans' histories
# are those its ledger's previous census gave says HISTORY_UNCHANGED instead.
SLOT_HISTORY = "history"
HISTORY_OFF = "history_off"
HISTORY_UNCHANGED = "history_unchanged"
HISTORY_OPS = ("", "alloc", "free", "evict", "owner", "tree", "restore_free", "restore_hold", "last_loc")
# ... and the same entries once more, for Perfetto: each an instant event (name: its op) on a track of
# its own per page (a THREAD_NAME "slot N" names it), written by the probe's writer thread next to the
# event that carried the history. The analysis reads the history from that event, never from these.
CAT_HISTORY = "kvdoctor.history"
THREAD_NAME = "thread_name"  # ph M: Perfetto's own name for a tid's track

VIOLATION_KINDS = (DOUBLE_FREE, DOUBLE_ALLOC, STALE_LAST_LOC, INDEX_OUT_OF_RANGE, USE_AFTER_FREE, LOCK_UNDERFLOW)

# A probe_status "off" with this `cause`: a part stopped because reading the host cost more than it
# may, not because something failed (the analysis says it as information, not as a warning).
OFF_FOR_COST = "cost"

# Finding kinds the analysis makes besides the violation kinds above.
MEMORY_GROWTH = "memory_growth"
MEMORY_CLASS_GROWTH = "memory_class_growth"
RETAINED_VIEW = "retained_view"
L3_STORE_BYTES = "l3_store_bytes"
HOST_GROWTH = "host_growth_sites"
PROBE_OFF = "probe_off"
PROBE_PARTIAL = "probe_partial"
EVENTS_DROPPED = "events_dropped"
TRACE_WRITE_FAILED = "trace_write_failed"
LEDGER_DISAGREES = "ledger_disagrees"
CONNECTOR_HELD_BLOCKS = "connector_held_blocks"
MM_FEATURES_HELD = "mm_features_held"  # finished requests' multimodal feature tensors still alive after their finish
CONTAINER_GROWTH = "container_growth"
STATUS_KINDS = (PROBE_OFF, PROBE_PARTIAL, TRACE_WRITE_FAILED)  # findings that tell a state, and count nothing

FINDING_KINDS = (
    ORPHAN_SLOTS,
    DOUBLE_FREE,
    DOUBLE_ALLOC,
    STALE_LAST_LOC,
    INDEX_OUT_OF_RANGE,
    USE_AFTER_FREE,
    TREE_HOLDS_FREE_SLOT,
    LOCK_UNDERFLOW,
    GRAPH_REPLAY_DURING_LOAD,
    REFCOUNT_DISAGREES,
    LORA_GHOST_UID,
    MAMBA_ORPHAN_SLOTS,
    SWA_SLOT_FREED_LIVE,
    PD_TRANSFER_FREED_IN_FLIGHT,
    PD_TRANSFER_STUCK,
    METADATA_DOUBLE_FREE,
    METADATA_INDEX_OUT_OF_RANGE,
    METADATA_ROWS_LEAKED,
    REQUEST_ROWS_LEAKED,
    CONNECTOR_HELD_BLOCKS,
    MM_FEATURES_HELD,
    CONTAINER_GROWTH,
    MEMORY_GROWTH,
    MEMORY_CLASS_GROWTH,
    RETAINED_VIEW,
    L3_STORE_BYTES,
    HOST_GROWTH,
    PROBE_OFF,
    PROBE_PARTIAL,
    EVENTS_DROPPED,
    TRACE_WRITE_FAILED,
    LEDGER_DISAGREES,
    FIX_APPLIED,
)


@dataclasses.dataclass
class Event:
    """One trace event, as in the Trace Event Format (`ph`, `name`, `pid`, `ts` in µs, `args`)."""

    ph: str
    name: str
    pid: int = 0
    ts: float = 0.0
    cat: str = ""
    tid: int = 0
    args: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ph": self.ph, "name": self.name, "pid": self.pid, "tid": self.tid}
        if self.ph != "M":
            out["ts"] = self.ts
        if self.cat:
            out["cat"] = self.cat
        if self.ph == "i":
            out["s"] = "t" if self.cat == CAT_HISTORY else "p"  # a slot's transition is on its own track
        out["args"] = self.args
        return out

    @classmethod
    def from_json_dict(cls, raw: dict[str, Any]) -> Event:
        """Builds an event from untrusted JSON: every field checked, the common types fast."""
        event = object.__new__(cls)
        get = raw.get
        ph, name, pid, ts, cat, tid, args = get("ph"), get("name"), get("pid"), get("ts"), get("cat"), get("tid"), get("args")
        event.ph = ph if type(ph) is str else ("" if ph is None else str(ph))
        event.name = name if type(name) is str else ("" if name is None else str(name))
        event.pid = pid if type(pid) is int and -(1 << 62) < pid < (1 << 62) else _as_int(pid or 0)
        event.ts = ts if type(ts) is float and ts == ts and abs(ts) != float("inf") else _as_float(ts or 0.0)
        event.cat = cat if type(cat) is str else ("" if cat is None else str(cat))
        event.tid = tid if type(tid) is int and -(1 << 62) < tid < (1 << 62) else _as_int(tid or 0)
        event.args = args if type(args) is dict else {}
        return event


def _as_int(value: Any) -> int:
    try:
        out = int(value)
    except (TypeError, ValueError, OverflowError):
        return 0
    return out if -(1 << 62) < out < (1 << 62) else 0


def _as_float(value: Any) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError, OverflowError):
        return 0.0
    return out if out == out and abs(out) != float("inf") else 0.0


def header_event(*, pid: int, engine: str, engine_version: str, process_title: str, extra: dict[str, Any] | None = None) -> Event:
    args: dict[str, Any] = {
        "schema": SCHEMA_ID,
        "engine": engine,
        "engine_version": engine_version,
        "pid": pid,
        "process_title": process_title,
    }
    if extra:
        args.update(extra)
    return Event(ph="M", name=HEADER, pid=pid, cat=CAT_PROBE, args=args)


def census_is_readable(args: dict[str, Any]) -> bool:
    """A census's orphan count, where it has one, is a plain count (not NaN, infinite, a string or
    negative): a damaged census must never read as a clean one."""
    if "orphan_slots" not in args:
        return True
    value = args["orphan_slots"]
    return type(value) is int and value >= 0
