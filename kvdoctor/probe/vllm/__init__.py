"""vLLM's roles: what each hooked BlockPool, KVCacheManager and Scheduler method means to the block
ledger and to the connector ledger."""

from kvdoctor.probe.hooks import Role
from kvdoctor.probe.vllm import connector, roles

ROLES: dict[str, Role] = {**roles.ROLES, **connector.ROLES}

__all__ = ["ROLES"]
