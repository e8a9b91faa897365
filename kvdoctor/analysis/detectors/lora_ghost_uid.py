"""lora_ghost_uid: a LoRA adapter was unloaded and its uid still holds a buffer slot of SGLang's
LoRA memory pool (sglang#21380, SGLang up to 0.5.15).

The probe's LoRA ledger (kvdoctor/probe/engines/sglang/lora_pool.py) reads the pool's slots after each
`LoRAManager.unload_lora_adapter` and names the unloaded uid found there, with the adapter and the
call site of the unload; its `lora_pool` counts (pool uids vs loaded adapters) say how many ghosts
the pool still held at the last count, at exit included.
"""

from __future__ import annotations

from typing import Any

from kvdoctor.analysis.detectors.base import ViolationDetector, as_list
from kvdoctor.analysis.named import scalars
from kvdoctor.trace import schema
from kvdoctor.units import as_count


class LoraGhostUidDetector(ViolationDetector):
    kind = schema.LORA_GHOST_UID
    unit = "slots"
    consumes = frozenset({schema.VIOLATION, schema.LORA_POOL})
    merged_counts = ("adapters",)

    def __init__(self) -> None:
        super().__init__()
        self.last_count: dict[tuple[int, str], dict[str, Any]] = {}

    def feed(self, event: schema.Event) -> None:
        if event.name == schema.LORA_POOL:
            key = (event.pid, str(event.args.get("pool", "")))
            if key in self.last_count or len(self.last_count) < 1024:
                self.last_count[key] = scalars(event.args)  # the counts the message reads, not the uid lists
            return
        super().feed(event)

    def message(self, count: int, allocator: str, site: str, evidence: dict[str, Any]) -> str:
        found = evidence.get("adapters")
        adapters: dict[str, Any] = found if isinstance(found, dict) else {}
        named = ", ".join(str(a) for a in list(adapters)[:4]) + (", ..." if len(adapters) > 4 else "")
        slots = ", ".join(str(s) for s in as_list(evidence.get("slot_ids"))[:8])
        unload = str(evidence.get("unload") or "LoRAManager.unload_lora_adapter")
        last = self.last_count.get((as_count(evidence.get("pid")), allocator))
        later = ""
        if last is not None:
            later = (
                f" At the last count ({last.get('when', '?')}) the pool's {as_count(last.get('slots'))} slots held "
                f"{as_count(last.get('pool_uids'))} adapter uid(s) for {as_count(last.get('loaded_adapters'))} loaded adapter(s): "
                f"{as_count(last.get('ghost_uids'))} ghost(s)."
            )
        return (
            f"{count} LoRA buffer slot(s) of {allocator} leaked: adapter {named or '?'} unloaded by {unload} at {site}, "
            f"and its uid still holds slot {slots or '?'}: a ghost uid, its weights kept for an adapter no request can use "
            f"until eviction picks it (sglang#21380: unload never frees the pool slot; fixed in SGLang 0.5.16 by "
            f"LoRAMemoryPool.remove_lora).{later}"
        )
