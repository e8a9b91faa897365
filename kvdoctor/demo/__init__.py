"""The embedded demo: SGLang's real allocator, radix tree and request pool under a multi-turn chat
workload with a planted fault."""
