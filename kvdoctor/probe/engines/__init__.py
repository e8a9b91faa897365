"""One package per engine (`sglang`, `vllm`): its roles, its per-process state, its adoption and
its feature ledgers. Loaded by name (`core.hooks.RoleRegistry.load`); the engines import no
other engine."""
