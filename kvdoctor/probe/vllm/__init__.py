"""vLLM's roles: what each hooked BlockPool and KVCacheManager method means to the block ledger."""
