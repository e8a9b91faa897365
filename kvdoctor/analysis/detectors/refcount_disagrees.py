"""refcount_disagrees: vLLM's own per-block reference count differs from the probe's ledger.

The block ledger (kvdoctor/probe/engines/vllm/blocks.py) counts references itself from the hooked
calls; at each census it reads vLLM's `KVCacheBlock.ref_cnt` back. A difference means a path
kvdoctor does not hook changed reference counts (the ledger's verdicts on those blocks cannot be
trusted), or vLLM's count itself went wrong. A warning: it says where to look, not what leaked.
"""

from typing import Any

from kvdoctor.analysis.detectors.base import ViolationDetector, as_list
from kvdoctor.analysis.findings import WARNING
from kvdoctor.trace import schema


class RefcountDisagreesDetector(ViolationDetector):
    kind = schema.REFCOUNT_DISAGREES
    unit = "slots"
    severity = WARNING

    def message(self, count: int, allocator: str, site: str, evidence: dict[str, Any]) -> str:
        blocks = as_list(evidence.get("block_ids"))
        shown = ", ".join(str(b) for b in blocks[:8]) + (", ..." if len(blocks) > 8 else "")
        return (
            f"vLLM's ref_cnt disagrees with the ledger on {evidence.get('blocks', '?')} block(s) ({count} slot(s)) "
            f"of {allocator} at the {site}"
            + (f" (blocks {shown})" if shown else "")
            + f"; vLLM's free queue holds {evidence.get('host_free_blocks', '?')} block(s), the ledger counts "
            f"{evidence.get('ledger_free_blocks', '?')} free: a path kvdoctor does not hook changed reference counts"
        )
