"""Model shapes and the standard workload shared by the GPU benchmarks (../shared/anchors).

Random bf16 weights of a real model's shape cost the same as the real weights, and need no download.
"""
from __future__ import annotations

import random
from pathlib import Path

import torch

SHAPES = {
    "tiny": dict(arch="llama", vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e4,
                 tie_word_embeddings=True),  # a CPU smoke test of the scripts, not a benchmark
    "qwen3-0.6b": dict(arch="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                       tie_word_embeddings=True),
    "llama-3.2-1b": dict(arch="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=5e5,
                         tie_word_embeddings=True, rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                 "original_max_position_embeddings": 8192}),
}


def workload(n: int, vocab_size: int = 10001) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench workload: (prompt token ids, output lengths), replayed from seed 0. Ids are
    folded into a vocabulary smaller than 10,001 (the tiny smoke shape) without changing any length."""
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) % vocab_size for _ in range(rng.randint(100, 1024))] for _ in range(n)]
    outputs = [rng.randint(100, 1024) for _ in range(n)]
    return prompts, outputs


def make_model_dir(shape: str, path: Path) -> Path:
    """An HF folder with random bf16 weights and a word-level tokenizer covering the whole vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen3Config

    spec = dict(SHAPES[shape])
    arch = spec.pop("arch")
    config_cls = Qwen3Config if arch == "qwen3" else LlamaConfig
    config = config_cls(max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=0,
                        pad_token_id=0, **spec)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0").save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


