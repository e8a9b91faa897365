"""SGLang's roles: what each hooked allocator, radix tree, request pool and HiCache method means
to the slot ledger (`roles`, `tree_roles`, `hicache`, `hicache_graphs`), to the L3 store's ledger (`mooncake_ledger`) and to the
LoRA memory pool's (`lora_pool`), to the Mamba state slots' (`mamba_pool` up to 0.5.10, `mamba_slots`
from 0.5.20), to the SWA pool's
(`swa_pool`), to PD decode's transfers (`pd_decode`, `pd_decode_roles`), to PD's metadata buffer
rows (`metadata_pool`), and the per-process
bookkeeping they share (`state`)."""

from kvdoctor.probe.base.context import Role
from kvdoctor.probe.engines.sglang import (
    hicache,
    hicache_graphs,
    lora_pool,
    mamba_pool,
    mamba_slots,
    metadata_pool,
    mooncake_ledger,
    pd_decode_roles,
    roles,
    swa_pool,
)

ROLES: dict[str, Role] = {
    **roles.ROLES,
    **hicache.ROLES,
    **hicache_graphs.ROLES,
    **mooncake_ledger.ROLES,
    **lora_pool.ROLES,
    **mamba_pool.ROLES,
    **mamba_slots.ROLES,
    **swa_pool.ROLES,
    **pd_decode_roles.ROLES,
    **metadata_pool.ROLES,
}
