"""SGLang's roles: what each hooked allocator, radix tree, request pool and HiCache method means
to the slot ledger (`roles`, `hicache`) and to the L3 store's ledger (`mooncake_ledger`), and the
per-process bookkeeping they share (`state`)."""

from kvdoctor.probe.hooks import Role
from kvdoctor.probe.sglang import hicache, mooncake_ledger, roles

ROLES: dict[str, Role] = {**roles.ROLES, **hicache.ROLES, **mooncake_ledger.ROLES}
