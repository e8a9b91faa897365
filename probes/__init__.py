"""The probe maps: one file per engine (sglang.toml, vllm.toml), each hook with the releases it holds for."""
