"""The ledgers: every KV slot's (SGLang) or block's (vLLM) state beside the engine's own lists."""
