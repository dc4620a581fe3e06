"""Tiny random-weight models and a tiny tokenizer, built on the fly (no downloads).

Every test that needs a model uses these: a byte-level BPE tokenizer trained on a fixed corpus (so
multi-byte characters are split across tokens, which exercises incremental detokenization) and HF
configs small enough that a CPU runs them in milliseconds.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

# The tiny real pretrained Llama (stories260K as an HF folder) beside the repository; PAGEDNB_TEST_LLAMA2C names
# another copy (the GPU machine gets the repository without ../shared: carry the folder and point at it)
LLAMA2C = Path(os.environ.get("PAGEDNB_TEST_LLAMA2C", "/work/shared/llama2c/stories260K_hf"))

CORPUS = [
    "Once upon a time there was a cat named Tom. Tom liked milk and long naps in the sun.",
    "The dog named Max ran to the park, found a red ball and brought it home.",
    "Paged attention stores the key value cache in fixed blocks of tokens.",
    "Continuous batching lets new requests join while others are still decoding.",
    "Unicode text: café, naïve, Grüße, 東京, こんにちは, emoji 🐱🐶🚀 and symbols ∑ ≤ ≥.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000, punctuation: ; , . ! ? ( ) [ ] { }.",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
VOCAB_SIZE = 384


def make_tokenizer(path: Path):
    """Train a byte-level BPE tokenizer on CORPUS and save it as an HF tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(path)
    return fast


def tiny_config(arch: str, **overrides):
    """An HF config of `arch` with a few layers and GQA, vocab matching the tiny tokenizer."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=0, eos_token_id=1, pad_token_id=2,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(**{"head_dim": 16, **common})
    if arch == "mistral":
        common.setdefault("sliding_window", 24)
        return MistralConfig(**common)
    from transformers import AutoConfig
    return AutoConfig.for_model(arch, **common)  # any other HF model_type ("gemma3_text", "phi3", ...)


def make_tiny_model(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a random-weight HF model of `arch` (safetensors) and the tiny tokenizer into `path`."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer(path)
    return path


def hf_greedy(path: Path, prompts: list[str], max_new_tokens: int, device: str = "cpu",
              attn_implementation: str | None = None) -> list[list[int]]:
    """HF transformers' greedy continuation of each prompt, in float32 with EOS ignored: the oracle
    that pagednb's greedy outputs must equal token for token. attn_implementation None: HF's default for
    the model; "eager" where the default may drop part of the model's math (transformers 5.17 runs
    Gemma 2 on "sdpa", which ignores attn_logit_softcapping)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              attn_implementation=attn_implementation).to(device)
    refs = []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids.to(device)
        out = hf.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=tok.pad_token_id)
        refs.append(out[0, ids.shape[1]:].tolist())
    return refs


# The prompts every engine-vs-HF equivalence test runs: short and long ones, a shared prefix (prefix hits),
# multi-byte text, and a prompt long enough to cross the tiny models' sliding windows (72 tokens).
SHARED_PREFIX = "Paged attention stores the key value cache in fixed blocks of tokens. "
EQUIVALENCE_PROMPTS = [
    "Once upon a time there was a cat",
    "The dog",
    SHARED_PREFIX + "Continuous batching lets new requests join",
    SHARED_PREFIX + "Unicode text: café",
    SHARED_PREFIX * 2 + "Numbers 0 1 2",
    "x",
]


def load_model_pair(path: Path):
    """(pagednb model, HF model) of one checkpoint, float32 on the CPU, HF with its eager attention."""
    from transformers import AutoModelForCausalLM

    from pagednb.attention.torch_ref import TorchReferenceBackend
    from pagednb.model import load_hf_config, load_model, model_spec

    cfg = load_hf_config(path)
    ours = load_model(path, cfg, model_spec(cfg), torch.float32, torch.device("cpu"), TorchReferenceBackend())
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return ours, theirs
