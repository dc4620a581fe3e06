"""Model shapes and the standard workload shared by the GPU benchmarks (../shared/anchors).

Random bf16 weights of a real model's shape cost the same as the real weights, and need no download.
Shapes in CHECKPOINT_FREE are too big to write to the GPU machine's disk quickly (Qwen3-30B-A3B: ~61 GB,
Llama-3.1-8B: ~16 GB): their folder holds config.json and the tokenizer only, pagednb runs them with
load_format="dummy" (random weights made on the device) and HF with `hf_model` (from the config, random
weights on the device).
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
    # the tensor-parallel scaling shape (benchmarks/throughput.py --tp 1,2)
    "llama-3.1-8b": dict(arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         rope_theta=5e5, tie_word_embeddings=False, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                  "original_max_position_embeddings": 8192}),
    "qwen3-30b-a3b": dict(arch="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          rope_theta=1e6, tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True),
    "gemma-3-1b": dict(arch="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                       num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                       sliding_window=512, sliding_window_pattern=6, query_pre_attn_scalar=256,
                       rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                        "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
                       tie_word_embeddings=True),
}
CHECKPOINT_FREE = {"qwen3-30b-a3b", "llama-3.1-8b"}


def workload(n: int, vocab_size: int = 10001) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench workload: (prompt token ids, output lengths), replayed from seed 0. Ids are
    folded into a vocabulary smaller than 10,001 (the tiny smoke shape) without changing any length."""
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) % vocab_size for _ in range(rng.randint(100, 1024))] for _ in range(n)]
    outputs = [rng.randint(100, 1024) for _ in range(n)]
    return prompts, outputs


def make_model_dir(shape: str, path: Path) -> Path:
    """An HF folder with random bf16 weights (none for CHECKPOINT_FREE shapes: config.json only) and a
    word-level tokenizer covering the whole vocabulary."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen3Config, Qwen3MoeConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    spec = dict(SHAPES[shape])
    arch = spec.pop("arch")
    config_cls = {"qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig, "gemma3_text": Gemma3TextConfig}.get(arch, LlamaConfig)
    config = config_cls(max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=0,
                        pad_token_id=0, **spec)
    if shape in CHECKPOINT_FREE:  # what save_pretrained of a model would record: pagednb picks its decoder by it
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
        config.save_pretrained(path)
        _save_tokenizer(config.vocab_size, path)
        return path
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    _save_tokenizer(config.vocab_size, path)
    del model
    torch.cuda.empty_cache()
    return path


def _save_tokenizer(vocab_size: int, path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0").save_pretrained(path)


def hf_model(model_dir: Path, device: str):
    """HF transformers' model of the folder in bf16 (sdpa attention): its checkpoint, or for a folder
    without one (CHECKPOINT_FREE) random weights initialised on the device from its config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if any(Path(model_dir).glob("*.safetensors")):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
        return model.to(device).eval()
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


