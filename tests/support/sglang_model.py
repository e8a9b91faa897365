"""Makes the tiny model the SGLang server tests serve: a 1,024-entry byte-level BPE tokenizer trained
on a few sentences and a random bf16 Llama (hidden 256, 2 layers, 4 heads / 2 KV heads), saved
locally. No download.

    python tests/support/sglang_model.py OUT_DIR [llama|swa|lfm2]

`swa`: a sliding-window model instead (a tiny Mellum: 4 layers, 64-token sliding layers alternating
with full ones, dense MLPs), for which SGLang builds its SWA pool (`SWATokenToKVPoolAllocator`).
`lfm2`: a hybrid model (a tiny LFM2: short-conv layers alternating with full-attention ones), for
which SGLang builds `HybridReqToTokenPool` with a `MambaPool` of conv states and a FULL + MAMBA
`UnifiedRadixCache`; its conv layers' math needs `lfm2_standins.py` on CPU.
"""

import os
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


def make(out: str, kind: str = "llama") -> None:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024, special_tokens=["<s>", "</s>", "<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    text = [
        "The quick brown fox jumps over the lazy dog.",
        "Hello world, this is a tiny tokenizer for SGLang tests.",
        "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt ut labore.",
    ] * 50
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    fast.save_pretrained(out)
    shape = {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": len(fast),
        "max_position_embeddings": 2048,
        "bos_token_id": fast.bos_token_id,
        "eos_token_id": fast.eos_token_id,
        "pad_token_id": fast.pad_token_id,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    if kind == "swa":
        from transformers import MellumConfig, MellumForCausalLM

        sliding = ["sliding_attention", "full_attention"] * 2
        config, model_cls = (
            MellumConfig(num_hidden_layers=4, head_dim=64, sliding_window=64, layer_types=sliding, mlp_layer_types=["dense"] * 4, **shape),
            MellumForCausalLM,
        )
    elif kind == "lfm2":
        from transformers import Lfm2Config, Lfm2ForCausalLM

        layers = ["conv", "full_attention"] * 2
        shape.pop("torch_dtype")
        config = Lfm2Config(
            num_hidden_layers=4,
            layer_types=layers,
            full_attn_idxs=[i for i, t in enumerate(layers) if t == "full_attention"],
            conv_L_cache=3,
            conv_bias=False,
            block_auto_adjust_ff_dim=False,
            torch_dtype="bfloat16",
            **shape,
        )
        model_cls = Lfm2ForCausalLM
    else:
        config, model_cls = LlamaConfig(num_hidden_layers=2, **shape), LlamaForCausalLM
    torch.manual_seed(0)
    model_cls(config).to(torch.bfloat16).save_pretrained(out)


if __name__ == "__main__":
    target = sys.argv[1]
    if not os.path.exists(os.path.join(target, "config.json")):
        make(target, sys.argv[2] if len(sys.argv) > 2 else "llama")
    print(target)
