"""A flight recorder per page of a host slot ledger: each page's last N transitions, in fixed arrays.

Every transition the ledger records (an alloc, a free, a free inside a tree eviction, a request
row taking the page, the tree taking it, a restore, a stale last_loc read) is one entry in the
page's ring of `N` (KVDOCTOR_SLOT_HISTORY, 8 by default; 0 turns it off): the operation and the
thread, the call site, the request row (and the rid it served then: requests.py's owner log), the
sequence number of the call, and the time.
The Python ledger (`slots.SlotLedger`) and the native path (csrc/ledger.c, `record` in native.h)
write the same arrays the same way, a few stores per page per call; nothing is read on the hot
path. A violation, a census naming orphans and `kvdoctor replay --slot` read them back.

Memory, fixed when the ledger is made: `N * 20 + 1` bytes a page (five int32 words an entry and
a one-byte head), 161 bytes at N = 8: 161 MB for a million-page pool, beside the 13 bytes a page
the ledger itself holds (and the KV cache's own hundreds of KB a page). Host ledgers only: a
ledger on a GPU keeps none, and what it names says so (`history_off`).

Layout (shared with the C, which checks nothing of it but the sizes it is handed):
  hist  int32 [pages * N, 5]: word 0 the op | thread index << 8, then site, row, seq, ms
  head  uint8 [pages]: transitions recorded into the page, modulo 256 (N divides 256)
  clock int64 [16]: [0] the last sequence number, [1] the recorders' start (CLOCK_MONOTONIC_COARSE,
        ns), [2:16] the idents of the threads seen (index 1..14; 15: another; 0: none). One clock
        (CLOCK) for every ledger of the process: its sequence numbers order transitions across
        ledgers, and the request table stamps each row's owner with it (requests.py), so that an
        entry names the request its row served when the entry was written, not the row's owner now.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from kvdoctor.probe.base.settings import env_count
from kvdoctor.trace import schema

ENV_ENTRIES = "KVDOCTOR_SLOT_HISTORY"
DEFAULT_ENTRIES = 8
WORDS = 5
CLOCK_LEN = 16
THREADS = CLOCK_LEN - 2  # threads told apart; later ones share index 15
MAX_PAGES_DUMPED = 8  # pages whose histories one finding carries
ENTRY_BYTES = WORDS * 4
OWNERS_KEPT = 32  # a request row's last owners its entries can name (requests.py): about 100 bytes each beside the rid

# Operation codes (native.h's OP_*): the index into schema.HISTORY_OPS.
OP_ALLOC, OP_FREE, OP_EVICT, OP_OWNER, OP_TREE, OP_RESTORE_FREE, OP_RESTORE_HOLD, OP_LAST_LOC = range(1, 9)
_COARSE = getattr(time, "CLOCK_MONOTONIC_COARSE", time.CLOCK_MONOTONIC)


def _now_ns() -> int:
    return time.clock_gettime_ns(_COARSE)


CLOCK = np.zeros(CLOCK_LEN, dtype=np.int64)  # every recorder's (and the request table's stamps)
CLOCK[1] = _now_ns()


def entries_wanted() -> int:
    """N: a power of two up to 64 (another value is rounded down to one), 0 for none."""
    n = env_count(ENV_ENTRIES, DEFAULT_ENTRIES, low=0, high=64)
    return 0 if n <= 0 else 1 << (n.bit_length() - 1)


def bytes_per_page(entries: int) -> int:
    return entries * ENTRY_BYTES + 1 if entries else 0


def setting_line() -> str:
    """What `kvdoctor probes` says of the recorder, as this environment sets it."""
    n = entries_wanted()
    if not n:
        return f"off ({ENV_ENTRIES}=0)"
    per_page = bytes_per_page(n)
    return (
        f"on: the last {n} transitions of every page of a host slot ledger, {per_page} bytes a page "
        f"({per_page} MB for a million pages), each entry naming the request its row served then (a row keeps "
        f"its last {OWNERS_KEPT} owners); findings carry them, `kvdoctor replay --slot N` prints one; "
        f"{ENV_ENTRIES}=0 turns it off, =N keeps N (a power of two up to 64); GPU ledgers keep none yet"
    )


class SlotHistory:
    """The rings of one ledger's pages (`pages` = num_pages + 2: the padding page and the sink
    are in the arrays, never recorded)."""

    def __init__(self, pages: int, entries: int) -> None:
        self.entries = entries
        self.mask = entries - 1
        # written through once here: zeros from calloc are mapped as they are first written, and a
        # ring filling over hours would read as the scheduler's own memory growing
        self.hist = np.empty((pages * entries, WORDS), dtype=np.int32)
        self.hist.fill(0)
        self.head = np.empty(pages, dtype=np.uint8)
        self.head.fill(0)
        self.clock = CLOCK
        self._local = threading.local()
        self.census_key: tuple[bytes, bytes] | None = None  # the pages and heads the last census gave

    @property
    def nbytes(self) -> int:
        return int(self.hist.nbytes + self.head.nbytes + self.clock.nbytes)

    def _thread(self) -> int:
        """This thread's index in the clock's table (native.h's `thread_index` twin)."""
        known: int = getattr(self._local, "index", 0)
        if known:
            return known
        self._local.index = index = self._find_thread(threading.get_ident())
        return index

    def _find_thread(self, ident: int) -> int:
        table = self.clock
        for i in range(2, CLOCK_LEN):
            value = int(table[i])
            if value == ident:
                return i - 1
            if value == 0:
                table[i] = ident
                return i - 1
        return CLOCK_LEN - 1

    def _stamp(self, op: int) -> tuple[int, int, int]:
        seq = (int(self.clock[0]) + 1) & 0xFFFFFFFF or 1
        self.clock[0] = seq
        ms = ((_now_ns() - int(self.clock[1])) // 1_000_000) & 0x7FFFFFFF
        return op | (self._thread() << 8), seq - (1 << 32) if seq >= 1 << 31 else seq, ms

    def one(self, page: int, op: int, site: int, row: int) -> None:
        """One page's transition (the scalar fast paths)."""
        word0, seq, ms = self._stamp(op)
        h = int(self.head[page])
        self.hist[page * self.entries + (h & self.mask)] = (word0, site, row, seq, ms)
        self.head[page] = (h + 1) & 0xFF

    def many(self, pages: np.ndarray, op: int, site: int, rows: Any) -> None:
        """One call's transition of `pages` (in the pool's body, once each: the caller's
        np.unique); `rows` a row for all or one per page."""
        if pages.size == 0:
            return
        word0, seq, ms = self._stamp(op)
        h = self.head[pages]
        at = pages * self.entries + (h & self.mask)
        hist = self.hist
        hist[at, 0] = word0
        hist[at, 1] = site
        hist[at, 2] = rows
        hist[at, 3] = seq
        hist[at, 4] = ms
        self.head[pages] = h + np.uint8(1)

    # ----- the read side (violations, censuses: never the hot path) -----

    def page_entries(self, page: int) -> list[tuple[int, int, int, int, int, int]]:
        """(op, thread, site, row, seq, ms), oldest first."""
        h = int(self.head[page])
        out = []
        for k in range(self.entries, 0, -1):
            word0, site, row, seq, ms = (int(x) for x in self.hist[page * self.entries + ((h - k) & self.mask)])
            if word0 & 0xFF:
                out.append((word0 & 0xFF, word0 >> 8, site, row, seq, ms))
        return out

    def thread_name(self, index: int) -> str:
        if index <= 0:
            return "?"
        if index >= CLOCK_LEN - 1:
            return "another thread"
        ident = int(self.clock[index + 1])
        for thread in threading.enumerate():
            if thread.ident == ident:
                return thread.name
        return f"thread {index} (ended)"

    def describe(self, pages: Any, page_size: int, site_name: Any, row_name: Any, rid_of: Any = None) -> dict[str, Any]:
        """The evidence a finding carries: the histories of its first MAX_PAGES_DUMPED pages; an
        entry whose row's owner then is known (`rid_of(row, seq)`) names its request too."""
        now_ms = (_now_ns() - int(self.clock[1])) // 1_000_000
        dumped = []
        for page in [int(p) for p in pages[:MAX_PAGES_DUMPED]]:
            if not 0 < page < self.head.shape[0] - 1:
                continue
            entries = []
            for op, thread, site, row, seq, ms in self.page_entries(page):
                entry = {
                    "op": schema.HISTORY_OPS[op] if op < len(schema.HISTORY_OPS) else f"op {op}",
                    "site": site_name(site) if site else "",
                    "row": row_name(row),
                    "seq": seq & 0xFFFFFFFF,
                    "thread": self.thread_name(thread),
                    "ago_ms": max(0, int(now_ms - ms)),
                }
                rid = rid_of(row, seq & 0xFFFFFFFF) if rid_of is not None and row >= 0 else None
                if rid is not None:
                    entry["rid"] = rid
                entries.append(entry)
            dumped.append({"page": page, "first_slot": page * page_size, "page_size": page_size, "entries": entries})
        return {schema.SLOT_HISTORY: dumped, "history_entries": self.entries} if dumped else {}


def for_ledger(pages: int, xp: Any, kernels: Any) -> tuple[SlotHistory | None, str]:
    """A ledger's recorder, or None and why it keeps none."""
    entries = entries_wanted()
    if not entries:
        return None, f"{ENV_ENTRIES}=0 turned the slot history off"
    if not xp.sync_free_branching or kernels is not None:
        return None, f"the ledger lives on {xp.device}: slot histories are kept for host ledgers only"
    return SlotHistory(pages, entries), ""


def record_pages(history: SlotHistory, num_pages: int, pages: Any, op: int, site: int, rows: Any, unique: bool) -> None:
    """One call's transition of the pool's `pages` (the padding page and the sink dropped), each
    page once with the row of its first mention, as the native path records them."""
    pages = np.asarray(pages).reshape(-1)
    keep = (pages >= 1) & (pages <= num_pages)
    pages = pages[keep]
    if not isinstance(rows, int):
        rows = np.asarray(rows).reshape(-1)[keep]
    if not unique:
        pages, first = np.unique(pages, return_index=True)
        if not isinstance(rows, int):
            rows = rows[first]
    history.many(pages, op, site, rows)


def evidence(ledger: Any, pages: Any, *, census: bool = False) -> dict[str, Any]:
    """A `slots.SlotLedger`'s histories of (the first MAX_PAGES_DUMPED of) `pages`, or why it keeps
    none. A census whose pages and their rings are the last census's says only that (a leak that
    stays would repeat the same histories at every census)."""
    history: SlotHistory | None = ledger.history
    if history is None:
        return {schema.HISTORY_OFF: ledger.history_off}
    if census:
        named = np.asarray(pages).reshape(-1)[:MAX_PAGES_DUMPED].astype(np.int64)
        key = (named.tobytes(), history.head[named].tobytes())
        if key == history.census_key:
            return {schema.HISTORY_UNCHANGED: True}
        history.census_key = key

    def row_name(row: int) -> int | str | None:
        return row if row >= 0 else None if row == -1 else str(ledger.requests.describe(row))

    return history.describe(np.asarray(pages).reshape(-1), ledger.page_size, ledger.sites.name, row_name, ledger.requests.owner_at)
