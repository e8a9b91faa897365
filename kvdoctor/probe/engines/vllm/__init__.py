"""vLLM's roles: what each hooked BlockPool, KVCacheManager and Scheduler method means to the block
ledger and to the connector ledger, and the V2 model runner's Mamba state column check."""

from kvdoctor.probe.base.context import Role
from kvdoctor.probe.engines.vllm import connector, mamba_index, roles

ROLES: dict[str, Role] = {**roles.ROLES, **connector.ROLES, **mamba_index.ROLES}

__all__ = ["ROLES"]
