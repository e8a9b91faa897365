"""The slot ledger: every KV slot's state beside the engine's own lists, its census, its request
rows and its device kernels. An engine's own ledgers live with the engine (`engines/vllm/blocks.py`
for vLLM's blocks)."""
