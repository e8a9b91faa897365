"""The slot ledger's vocabulary, shared by its host/torch path, its Triton kernels and the native path.

A page's state byte is FREE, OWNED (by a request), TREE (held by the radix tree), TREE | FREE (a
tree still pointing at a freed page) or RESERVED (the padding page and the sink where
out-of-range indices are parked). Each broken rule has a per-page violation bit and a counter
slot.
"""

from __future__ import annotations

from kvdoctor.trace import schema

FREE = 1
OWNED = 2
TREE = 4
RESERVED = 8

# Violation bits (per page) and counter slots, one per kind the slot ledger raises.
KIND_BITS = {
    schema.DOUBLE_FREE: 1,
    schema.DOUBLE_ALLOC: 2,
    schema.STALE_LAST_LOC: 4,
    schema.INDEX_OUT_OF_RANGE: 8,
    schema.USE_AFTER_FREE: 16,
}
KIND_SLOT = {kind: i for i, kind in enumerate(KIND_BITS)}

# What one hooked call does to the pages it names (the kernels' OP argument).
OP_ALLOC = 0
OP_FREE = 1
OP_TREE_INSERT = 3
OP_LAST_LOC = 4

MAX_IDS_IN_EVIDENCE = 64  # slot ids listed in one event
MAX_NAMED_PAGES = 4096  # pages whose sites/requests are tallied in one event
