"""SGLang's roles: what each hooked allocator, radix tree, request pool and HiCache method means
to the slot ledger."""
