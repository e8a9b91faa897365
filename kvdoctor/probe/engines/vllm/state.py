"""vLLM's block ledgers in one process: found per pool, adopted with proof, and their censuses.

The census runs when the last live request is freed (at most one per
`KVDOCTOR_IDLE_CENSUS_INTERVAL_S`; one that was due but rate-limited runs before the next
allocation, or from the writer thread once the engine has been quiet for a second) and at exit.
vLLM's API server sends its engine core SIGTERM and force-kills it 5 s later, so the exit census
runs (and is flushed to the trace) when `EngineCore.shutdown` begins; multiprocessing's finalizers
and `atexit` run it too where the process gets that far. A busy machine can take longer than those
5 s: under `kvdoctor run` the API server asks for a census before it sends SIGTERM at all.
"""

from __future__ import annotations

import atexit
import threading
import time
from typing import TYPE_CHECKING, Any

from kvdoctor.probe.base.context import positive_ints
from kvdoctor.probe.base.rank import ledger_name
from kvdoctor.probe.engines.vllm.adopt import Holders, read_holders
from kvdoctor.probe.engines.vllm.blocks import BlockLedger
from kvdoctor.probe.engines.vllm.connector import ConnectorHolds
from kvdoctor.probe.readings import containers
from kvdoctor.trace import schema

if TYPE_CHECKING:
    from kvdoctor.probe.base.context import ProbeContext

QUIET_S = 1.0  # the writer thread takes a due idle census only after this long without a hooked call
SHUTDOWN_BUSY_WAIT_S = 3.0  # asked for a census at shutdown while busy: wait this long for quiet (of the 5 s the API server is held)


class _Current(threading.local):
    def __init__(self) -> None:
        self.request: str | None = None


class VllmState:
    """Per process: the block ledgers (one per pool), the live requests, the census schedule."""

    def __init__(self, probe: ProbeContext) -> None:
        self.probe = probe
        self.ledgers: dict[int, BlockLedger] = {}
        self.pools: dict[int, Any] = {}
        self.live: set[str] = set()
        self.current = _Current()
        self.census_due = False
        self.last_census = -1e9
        self.last_call = time.monotonic()
        self.exit_done = False
        self.allocations = 0  # allocate_slots calls that returned blocks
        self.live_peak = 0  # the most live requests since the last container walk
        self.lock = threading.Lock()
        atexit.register(self.exit_census)
        try:
            from multiprocessing import util

            util.Finalize(None, self.exit_census, exitpriority=101)  # ahead of the probe's own (100)
        except Exception:
            pass

    # ----- ledgers -----

    def ledger_for(self, pool: Any, in_flight: Any = None) -> BlockLedger:
        """The pool's ledger; made (and the pool's state adopted) at the first call the probe sees.
        `in_flight`: the blocks the call being made is freeing (their holders let go a moment ago)."""
        ledger = self.ledgers.get(id(pool))
        if ledger is not None:
            return ledger
        num_blocks, block_size = positive_ints(pool, "num_gpu_blocks", "hash_block_size")
        null = getattr(pool, "null_block", None)
        probe = self.probe
        ledger = BlockLedger(
            name=ledger_name(type(pool).__name__, len(self.ledgers)),
            num_blocks=num_blocks,
            block_size=block_size,
            null_block_id=getattr(null, "block_id", None),
            emit=probe.emitter.emit,
            site_name=probe.sites.name,
        )
        self.ledgers[id(pool)] = ledger
        self.pools[id(pool)] = pool
        site = probe.sites.intern(("held-at-attach",), lambda: schema.SITE_HELD_AT_ATTACH)
        try:
            adopted = ledger.adopt(pool, site)
        except Exception as exc:  # a pool without the blocks we know: counted from now on, as before
            adopted = 0
            probe.fail("vllm_adopt", exc)
        probe.status(
            "on",
            f"block ledger for {ledger.name}" + (f", adopted in use: {adopted} block(s) referenced" if adopted else ""),
            allocator=ledger.name,
            engine="vllm",
            blocks=num_blocks,
            block_size=block_size,
            caching=bool(getattr(pool, "enable_caching", False)),
            adopted_blocks=adopted,
        )
        if adopted:
            self._prove_adoption(ledger, pool, in_flight, adopted)
        if probe.rendezvous is not None:
            probe.rendezvous.register()  # under `run`: the API server asks for a census before its SIGTERM
        return ledger

    def _prove_adoption(self, ledger: BlockLedger, pool: Any, in_flight: Any, adopted: int) -> None:
        """Reads who held the adopted references (adopt.py); judged from now on where the books
        balance, else said and left unjudged until every reference from then is given back."""
        probe = self.probe
        try:
            assert ledger.adopted is not None
            holders = read_holders(pool, ledger.adopted, in_flight, ledger.null_block_id)
        except Exception as exc:
            probe.fail("vllm_adopt", exc)
            holders = Holders(reason=f"reading the holders failed ({type(exc).__name__})")
        if not holders.reason:
            early = ledger.prove_adoption(holders.by_block, probe.sites.intern(("before-attach",), lambda: schema.SITE_BEFORE_ATTACH))
            with self.lock:
                self.live |= holders.requests
            probe.status(
                "on",
                f"adopted {ledger.name}: {adopted} block(s) referenced, held by {len(holders.requests)} request(s) "
                + (f"and {early} block(s) with references no holder explains (leaked before attach)" if early else "and nothing else"),
                allocator=ledger.name,
                engine="vllm",
                component="adoption",
                adopted_requests=len(holders.requests),
                before_attach_blocks=early,
            )
            return
        reason = (
            f"the block pool {ledger.name} was in use when kvdoctor came: {adopted} block(s) referenced then are not "
            f"judged until every reference from then is given back, because {holders.reason}; everything the probe "
            "sees happen from now on is"
        )
        probe.emitter.emit(schema.PROBE_STATUS, {"component": "adoption", "state": "partial", "allocator": ledger.name, "reason": reason})

    def set_block_size(self, manager: Any) -> None:
        """The manager knows the block size; the pool only its hash block size (equal for one group)."""
        pool = getattr(manager, "block_pool", None)
        ledger = self.ledgers.get(id(pool)) if pool is not None else None
        if ledger is None or getattr(ledger, "_size_checked", False):
            return
        ledger._size_checked = True  # type: ignore[attr-defined]
        containers.sizes_state(self.probe).watch(type(manager).__name__, manager, "vllm.", self.container_context)
        managers = getattr(getattr(manager, "coordinator", None), "single_type_managers", None) or ()
        sizes = {getattr(m, "block_size", None) for m in managers}
        if len(sizes) == 1:
            size = sizes.pop()
            if isinstance(size, int) and size > 0:
                ledger.block_size = size

    def container_context(self) -> dict[str, int]:
        """What the container walk emits beside the sizes: the most requests live since the last
        walk, allocations served, and the pools' blocks (a cache keyed by block cannot hold more)."""
        peak, self.live_peak = self.live_peak, len(self.live)
        return {
            "live_requests": max(peak, len(self.live)),
            "allocations": self.allocations,
            "pool_blocks": sum(ledger.num_blocks for ledger in list(self.ledgers.values())),
        }

    # ----- census -----

    def census(self, reason: str) -> None:
        probe = self.probe
        if not probe.ledger_is_on("blocks"):
            return
        with self.lock:
            self.census_due = False
            self.last_census = time.monotonic()
            live = set(self.live)
        connector = probe.states.get("vllm_connector")
        held: set[str] = set()
        extra: dict[str, Any] = {}
        if isinstance(connector, ConnectorHolds) and probe.ledger_is_on("connector"):
            held = connector.held_requests()
            extra = connector.census_args()
        for key, ledger in list(self.ledgers.items()):
            try:
                ledger.census(reason=reason, live_requests=live, pool=self.pools.get(key), held_requests=held, extra=extra)
            except Exception as exc:
                probe.fail("vllm_census", exc)

    def idle(self) -> None:
        """The last live request was freed: a census now, or as soon as the rate limit allows."""
        if time.monotonic() - self.last_census >= self.probe.idle_census_interval_s:
            self.census("idle")
        else:
            self.census_due = True

    def periodic(self, probe: ProbeContext) -> None:
        if not probe.serving_marked and (self.allocations or self.live):
            probe.mark_serving("a request was given KV blocks")
        if not probe.ledger_is_on("blocks"):
            return
        try:
            if (
                self.census_due
                and not self.live
                and time.monotonic() - self.last_call >= QUIET_S
                and time.monotonic() - self.last_census >= probe.idle_census_interval_s
            ):
                self.census("idle")
            for ledger in list(self.ledgers.values()):
                probe.emitter.counter(schema.LEDGER_COUNTER, ledger.counter_args())
        except Exception as exc:
            probe.fail("vllm_poll", exc)

    def census_at_shutdown(self, probe: ProbeContext, waited_s: float) -> dict[str, Any] | None:
        """From the writer thread, the API server waiting to stop this engine core (it SIGKILLs
        what has not exited 5 s after its SIGTERM, before `EngineCore.shutdown` may have run): a
        census once the engine is quiet, so it never races the engine's thread; None while it is
        not, for up to SHUTDOWN_BUSY_WAIT_S; then no census, and the exit census runs if the
        engine core reaches its shutdown."""
        if not self.ledgers or not probe.ledger_is_on("blocks"):
            return {"census": "none", "reason": "no block ledger"}
        if not self.live and time.monotonic() - self.last_call >= QUIET_S:
            started = time.monotonic()
            self.census("shutdown")
            for ledger in list(self.ledgers.values()):
                probe.emitter.counter(schema.LEDGER_COUNTER, ledger.counter_args())
            return {"census": "shutdown", "census_s": round(time.monotonic() - started, 3)}
        if waited_s < SHUTDOWN_BUSY_WAIT_S:
            return None
        return {"census": "none", "reason": f"busy at shutdown ({len(self.live)} live request(s))"}

    def exit_census(self) -> None:
        if self.exit_done:
            return
        self.exit_done = True
        connector = self.probe.states.get("vllm_connector")
        if isinstance(connector, ConnectorHolds):
            try:
                connector.close(self.probe, "exit")  # the overdue holds, with their age at the end
            except Exception as exc:
                self.probe.fail("vllm_connector_exit", exc)
        if not self.ledgers:
            return
        try:
            self.census("exit")
            for ledger in list(self.ledgers.values()):
                self.probe.emitter.counter(schema.LEDGER_COUNTER, ledger.counter_args())
            self.probe.emitter.flush()  # on disk now: the process may be killed before its exit hooks
        except Exception as exc:
            self.probe.fail("vllm_exit", exc)

    def close(self, probe: ProbeContext, reason: str) -> None:
        self.exit_census()


def state(probe: ProbeContext) -> VllmState:
    return probe.state("vllm", VllmState)
