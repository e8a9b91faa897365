"""What each hooked radix tree method means to the slot ledger: an insert takes a request's slots
into the tree, an eviction gives them back through the allocator's frees, an unlock may underflow.

These roles have a `fast_kind`: their healthy case is done by the native path's ledger operation of
that kind (tree_ops.c), reading what `fast_names` names; a change to what such a role records is
made there too (tests/integration/test_native.py compares the two paths).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvdoctor.probe import native
from kvdoctor.probe.base.context import Args, Hook, Kwargs, Role
from kvdoctor.probe.engines.sglang.state import sglang_state
from kvdoctor.trace import schema

if TYPE_CHECKING:
    from kvdoctor.probe.base.context import ProbeContext


class TreeRole(Role):
    """A tree role feeds the slot ledger."""

    ledger = "slots"


def _tree_size(tree: Any) -> int:
    return int(tree.evictable_size()) + int(tree.protected_size())


def _adopted(tree: Any, result: Any, value: Any, tail: Any) -> Any:
    """The request's slots the tree holds after an insert that grew it past the key's new tail.

    With HiCache, UnifiedRadixCache restores an evicted node (its copy kept on the host) from the
    inserting request's own slots, inside the matched prefix (`_unevict_node_on_insert`); the
    prefix's duplicates it freed meanwhile. Where the tree's path now holds the request's slot, that
    slot is the tree's; elsewhere the tree's own slot stands (already the tree's: no change). Read
    on the value's device, element by element: no host read-back.
    """
    path_of = getattr(tree, "path_device_indices", None)
    node = getattr(result, "last_device_node", None)
    if path_of is None or node is None:
        return tail
    path = path_of(node)
    n = min(len(path), len(value))
    mine = value[:n]
    return mine.where(path[:n].to(mine.device, mine.dtype) == mine, path[:n].to(mine.device, mine.dtype))


_TREE_NAMES = {"owner": "token_to_kv_pool_allocator", "size": "evictable_size", "size_also": "protected_size", "prefix": "prefix_len"}
# The native path steps aside for a tree with a HiCache controller: its inserts can take slots
# inside the matched prefix (`_adopted`), which only the Python role works out.
_TREE_INSERT_NAMES = {**_TREE_NAMES, "aside": "cache_controller"}


class TreeInsertRole(TreeRole):
    fast_kind = "tree_insert"
    fast_names = {**_TREE_INSERT_NAMES, "carrier": "params", "slots": "value"}
    wants_site = True
    reads = {"params": 0}

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        ledger = sglang_state(probe).tree_ledger(obj)
        if ledger is None:
            return None
        return (ledger, site, _tree_size(obj))

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        if ctx is None:
            return
        ledger, site, size_before = ctx
        value = self.inserted_value(hook, args, kwargs)
        if value is None or not hasattr(value, "numel"):
            return
        grown = _tree_size(obj) - size_before
        prefix_len = getattr(result, "prefix_len", result if isinstance(result, int) else None)
        if grown <= 0 or not isinstance(prefix_len, int):
            return
        taken = value[prefix_len : prefix_len + grown]
        if grown > len(taken):  # the tree took slots inside the matched prefix too
            taken = _adopted(obj, result, value, taken)
        with ledger.lock:
            ledger.on_tree_insert(taken, site)

    def inserted_value(self, hook: Hook, args: Args, kwargs: Kwargs) -> Any:
        return getattr(hook.arg(args, kwargs, "params"), "value", None)


class TreeInsertKeyValueRole(TreeInsertRole):
    """Before 0.5.9: `insert(key, value, chunked[, priority]) -> prefix_len`."""

    reads = {"key": 0, "value": 1}
    fast_names = {**_TREE_INSERT_NAMES, "carrier": "value"}

    def inserted_value(self, hook: Hook, args: Args, kwargs: Kwargs) -> Any:
        return hook.arg(args, kwargs, "value")


class TreeEvictRole(TreeRole):
    fast_kind = "tree_evict"
    fast_names = {"owner": _TREE_NAMES["owner"]}

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        sglang_state(probe).tree_ledger(obj)
        native.evict_add(1)
        return True

    def finally_(self, probe: ProbeContext, ctx: Any) -> None:
        if ctx:
            native.evict_add(-1)


class TreeUnlockRole(TreeRole):
    fast_kind = "tree_unlock"
    fast_names = {"node": "node", "count": "lock_ref", "root": "root_node"}
    wants_site = True
    reads = {"node": 0}

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        node = hook.arg(args, kwargs, "node")
        lock_ref = getattr(node, "lock_ref", None)
        if isinstance(lock_ref, int) and lock_ref <= 0 and node is not getattr(obj, "root_node", None):
            probe.emitter.emit(
                schema.VIOLATION,
                {
                    "kind": schema.LOCK_UNDERFLOW,
                    "count": 1,
                    "site": probe.sites.name(site),
                    "note": "dec_lock_ref on a node whose lock_ref is already 0: its slots become evictable while a request still uses them",
                },
            )
        return None


class TreeResetRole(TreeRole):
    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        ledger = sglang_state(probe).tree_ledger(obj)
        if ledger is not None:
            with ledger.lock:
                ledger.on_tree_reset()
