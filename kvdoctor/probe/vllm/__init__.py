"""vLLM's roles: what each hooked BlockPool and KVCacheManager method means to the block ledger."""

from kvdoctor.probe.vllm.roles import ROLES

__all__ = ["ROLES"]
