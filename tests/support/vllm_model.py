"""Makes the tiny random-weight Llama model the vLLM tests and the bench serve (no download).

    python tests/support/vllm_model.py DIR     # idempotent: an existing model is kept

head_dim is 64 (hidden 256 / 4 heads): the CPU attention backend refuses 16.
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_DIR = os.path.join(REPO, ".venv-vllm", "tiny-llama")


def ensure_model(directory: str = DEFAULT_DIR) -> str:
    directory = os.path.abspath(directory)
    if os.path.exists(os.path.join(directory, "config.json")) and any(name.endswith(".safetensors") for name in os.listdir(directory)):
        return directory
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    tmp = directory + ".tmp"
    LlamaForCausalLM(cfg).save_pretrained(tmp)
    os.replace(tmp, directory)
    return directory


if __name__ == "__main__":
    print(ensure_model(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_DIR))
