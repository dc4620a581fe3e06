"""Train pagednb's embedded default model: a tiny Llama that tells short animal stories.

Builds its corpus itself (tools/story_corpus.py), trains a byte-level BPE tokenizer with `tokenizers`,
trains a small LlamaForCausalLM with plain PyTorch, and saves a standard HF model folder
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json with the chat template,
generation_config.json, README.md model card). Seeded; run on a GPU it takes a few minutes:

    python tools/train_tiny_model.py --out pagednb/default_model
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from story_corpus import HELD_OUT, corpus  # noqa: E402

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|end|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]
EVAL_PROMPTS = ["Tell me a story about a cat named Tom.", "Tell me a story about a dog named Max."]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--conversations", type=int, default=200_000)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=704)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seconds", type=float, default=360, help="stop early past this training time")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args()


def render(conversations: list[list[dict]]) -> list[str]:
    """The exact text the chat template produces for each whole conversation."""
    import jinja2
    template = jinja2.Environment().from_string(CHAT_TEMPLATE)
    return [template.render(messages=c, add_generation_prompt=False) for c in conversations]


def train_tokenizer(texts: list[str], vocab_size: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", pad_token="<|pad|>",
                                   chat_template=CHAT_TEMPLATE, model_max_length=512)
    fast.save_pretrained(out)
    _template_into_tokenizer_config(out)
    return fast


def _template_into_tokenizer_config(out: Path) -> None:
    """Keeps the chat template in tokenizer_config.json (newer transformers write a .jinja file)."""
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # loadable by transformers 4.x and 5.x alike
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    for extra in ("chat_template.jinja", "special_tokens_map.json"):
        (out / extra).unlink(missing_ok=True)


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return torch.tensor([t for seq in ids for t in seq], dtype=torch.long)


def build_model(args, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    end = tokenizer.convert_tokens_to_ids("<|end|>")
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=end, pad_token_id=tokenizer.pad_token_id, initializer_range=0.02,
        architectures=["LlamaForCausalLM"],
    )
    return LlamaForCausalLM(config)


def lr_at(step: int, args) -> float:
    warmup = max(1, args.steps // 30)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model, stream: torch.Tensor, args) -> list[tuple[int, float]]:
    device = torch.device(args.device)
    model.to(device).train()
    stream = stream.to(device)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda")
    offsets = torch.arange(args.seq_len + 1, device=device)
    history, t0 = [], time.perf_counter()
    for step in range(args.steps):
        starts = torch.randint(0, stream.numel() - args.seq_len - 1, (args.batch,), generator=gen).to(device)
        batch = stream[starts[:, None] + offsets]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = _loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        out_of_time = time.perf_counter() - t0 > args.max_seconds
        if step % 100 == 0 or step == args.steps - 1 or out_of_time:
            history.append((step, round(loss.item(), 4)))
            print(f"step {step:5d}  loss {loss.item():.4f}  {time.perf_counter() - t0:.0f}s", flush=True)
        if out_of_time:
            print(f"stopping at step {step}: past --max-seconds {args.max_seconds}", flush=True)
            break
    return history


def _loss(model, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


@torch.no_grad()
def sample_replies(model, tokenizer, device: str) -> dict[str, str]:
    model.eval()
    replies = {}
    for prompt in EVAL_PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"].to(device)
        out = model.generate(ids, max_new_tokens=200, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        replies[prompt] = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=False)
    return replies


def write_model_card(out: Path, args, stats: dict) -> None:
    held_out = ", ".join(f"a {a} named {n}" for a, n in sorted(HELD_OUT))
    lines = [
        "# pagednb tiny story model", "",
        "pagednb's embedded default model: a small Llama trained from scratch by `tools/train_tiny_model.py` on a",
        "synthetic chat corpus of animal stories and simple questions (`tools/story_corpus.py`). It exists so",
        "that pagednb's README, notebooks and tests run offline with readable output. It knows nothing else.", "",
        f"Held out of training: {held_out} (the names and animals occur, never together).", "",
        "| what | value |", "| --- | --- |",
        *[f"| {k} | {v} |" for k, v in stats.items() if k != "samples"], "",
        "## Greedy replies after training", "",
        *[f"**{p}**\n\n> {r}\n" for p, r in stats["samples"].items()],
        "Reproduce: `python tools/train_tiny_model.py --out pagednb/default_model` (seed "
        f"{args.seed}; the loss curve differs slightly between GPUs).",
    ]
    (out / "README.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    texts = render(corpus(args.conversations, args.seed))
    tokenizer = train_tokenizer(texts, args.vocab_size, args.out)
    stream = token_stream(tokenizer, texts)
    print(f"corpus: {len(texts)} conversations, {sum(map(len, texts))} characters, {stream.numel()} tokens "
          f"({time.perf_counter() - t0:.0f}s)", flush=True)
    model = build_model(args, tokenizer)
    num_params = sum(p.numel() for p in model.parameters())
    t1 = time.perf_counter()
    history = train(model, stream, args)
    train_seconds = time.perf_counter() - t1
    samples = sample_replies(model, tokenizer, args.device)
    for p, r in samples.items():
        print(f"\n{p}\n{r}")
    model.to(torch.bfloat16).save_pretrained(args.out, safe_serialization=True)
    model.generation_config.save_pretrained(args.out)
    stats = {
        "parameters": f"{num_params:,}",
        "architecture": f"LlamaForCausalLM, {args.layers} layers, hidden {args.hidden}, {args.heads} heads "
                        f"({args.kv_heads} kv), vocab {len(tokenizer)}, tied embeddings, stored in bfloat16",
        "corpus": f"{len(texts):,} conversations, {sum(map(len, texts)):,} characters, {stream.numel():,} tokens",
        "training": f"{history[-1][0] + 1} steps x {args.batch} x {args.seq_len} tokens, AdamW lr {args.lr}, seed {args.seed}",
        "final loss": history[-1][1],
        "loss curve (step, loss)": " ".join(f"{s}:{l}" for s, l in history[::5] + history[-1:]),
        "training time": f"{train_seconds:.0f} s",
        "hardware": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu",
        "software": f"torch {torch.__version__}, transformers {__import__('transformers').__version__}",
        "samples": samples,
    }
    write_model_card(args.out, args, stats)
    print(json.dumps({k: v for k, v in stats.items() if k != "samples"}, indent=1))


if __name__ == "__main__":
    main()
