"""index_out_of_range: a slot index outside the KV buffer (an illegal memory access on a GPU), or a
Mamba state column vLLM's V2 model runner seeded past the request's mamba blocks, before the
kernel that reads it (vllm#55600; kvdoctor/probe/engines/vllm/mamba_index.py)."""

from typing import Any

from kvdoctor.analysis.detectors.base import ViolationDetector
from kvdoctor.trace import schema


class IndexOutOfRangeDetector(ViolationDetector):
    kind = schema.INDEX_OUT_OF_RANGE
    unit = "indices"

    def message(self, count: int, allocator: str, site: str, evidence: dict[str, Any]) -> str:
        if "mamba_state_column" in evidence:
            return self.mamba_message(count, allocator, site, evidence)
        rows = evidence.get("valid_rows") or ["?", "?"]
        return (
            f"{count} slot index(es) outside the KV buffer reached {site} (worst {evidence.get('bad_index')}, "
            f"valid rows {rows[0]}..{rows[-1]}, -1 only as 'no prefix'); on a GPU this is an illegal memory access"
        )

    @staticmethod
    def mamba_message(count: int, allocator: str, site: str, evidence: dict[str, Any]) -> str:
        blocks = evidence.get("mamba_blocks_computed")
        bound = f"columns 0..{blocks - 1}" if isinstance(blocks, int) and blocks > 0 else "only -1 (nothing computed)"
        return (
            f"{count} Mamba state column(s) out of range before the kernel: {allocator}.add_request seeded column "
            f"{evidence.get('mamba_state_column')} for request {evidence.get('request')} (req_index "
            f"{evidence.get('req_index')}), whose {evidence.get('num_computed_tokens')} computed token(s) fill "
            f"{blocks} mamba block(s) of {evidence.get('mamba_block_size')} tokens ({bound}; block ids per KV cache "
            f"group {evidence.get('block_ids_per_group')}), at {site}. The next step's preprocess_mamba_align_fused_kernel "
            f"takes it as the source column and the pre-copy reads the mamba block table there: out of bounds on a GPU. "
            f"vllm#55600: vLLM 0.28-0.31 divide the computed tokens by cache_config.block_size "
            f"({evidence.get('block_size')}), not mamba_block_size; 0.32 divides by mamba_block_size (PR#55601)"
        )
