"""Offline throughput on the standard workload (nano-vllm's bench, ../shared/anchors): 256 requests,
prompt and output lengths uniform in [100, 1024], random token ids, seed 0, temperature 0.6, EOS
ignored; throughput = output tokens / wall time (prefill included). Random bf16 weights of the
Qwen3-0.6B or Llama-3.2-1B shape (the cost does not depend on the values; nothing is downloaded).

    python benchmarks/throughput.py --shape qwen3-0.6b [--requests 256]
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from common import print_table, save

SHAPES = {
    "qwen3-0.6b": dict(arch="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                       tie_word_embeddings=True),
    "llama-3.2-1b": dict(arch="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=5e5,
                         tie_word_embeddings=True, rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                 "original_max_position_embeddings": 8192}),
}


def workload(n: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(n)]
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


def run_pagednb(model_dir: Path, prompts, outputs, args) -> dict:
    from pagednb import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(str(model_dir), max_model_len=2048, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=0.9)
    startup = time.perf_counter() - t0
    llm.generate([p[:32] for p in prompts[:8]], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for o in outputs]
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(outputs)
    stats = llm.stats()
    llm.close()
    return {"wall_s": wall, "output_tok_per_s": produced / wall,
            "total_tok_per_s": (produced + sum(map(len, prompts))) / wall, "startup_s": startup,
            "steps": stats["steps"], "preemptions": stats["preemptions"], "kv_blocks": stats["num_blocks"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    args = parser.parse_args()
    prompts, outputs = workload(args.requests)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(args.shape, Path(tmp) / args.shape)
        result = run_pagednb(model_dir, prompts, outputs, args)
    rows = [["pagednb", args.shape, args.requests, sum(outputs), result["wall_s"], result["output_tok_per_s"],
             result["steps"], result["preemptions"]]]
    print(f"\nThroughput, {args.requests} requests, {sum(map(len, prompts))} prompt + {sum(outputs)} output tokens")
    print_table(["engine", "shape", "requests", "output tokens", "wall s", "output tok/s", "steps", "preemptions"], rows)
    path = save(f"throughput_{args.shape}", {"shape": args.shape, "requests": args.requests,
                                               "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(outputs),
                                               "pagednb": result})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
