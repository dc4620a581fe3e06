"""What a JSON-schema bitmask adds to a decode step: batch 64, random bf16 weights of the Qwen3-0.6B shape.

Four runs of the same 64 requests (32-token random prompts, 128 output tokens, greedy):
- plain: no grammar (asynchronous scheduling, the default on a GPU);
- plain, synchronous: no grammar, async scheduling off;
- json schema: every request has a JSON schema (an object with one free string), asynchronous scheduling on:
  each step's forward is launched before the previous step's tokens reach the host, its sampling deferred
  until the matchers took them and its rows were filled on the grammar thread (xgrammar's batched fill) while
  the engine thread built outputs; the mask applied to the bf16 logits in place by one kernel
  (engine/structured_output.py);
- json schema, synchronous: the same with async scheduling off.
The figure is the generate call's wall time over its engine steps (one prefill step, the rest decode at
64 rows: output tokens / 64 says whether rows ended early), the best of three generate calls per run (a
shared host's other work only ever adds time); the table shows the added fraction over each plain run
(target < 10% over plain). Not timed per step: reading each step's events back would stall the
asynchronous run.

The vocabulary: the shape's 151,936 ids, as a word-level tokenizer whose first ids are the printable ASCII
characters (JSON's punctuation among them) and the rest random 2-8 character strings of letters and
digits (seed 0), so xgrammar's mask work covers a real vocabulary's size. With random weights a request
almost never closes its string, so all 64 rows stay in every step.

    python benchmarks/structured_output.py [--shape qwen3-0.6b] [--steps 128]
"""
from __future__ import annotations

import argparse
import random
import string
import tempfile
import time
from pathlib import Path

import torch
from common import print_table, save
from shapes import SHAPES, make_model_dir

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def character_tokenizer(path: Path, vocab_size: int) -> None:
    """Replaces make_model_dir's tokenizer with one of vocab_size strings (see the module docstring)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    pieces = ["<eos>"] + [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]
    seen = set(pieces)
    while len(pieces) < vocab_size:
        piece = "".join(rng.choices(string.ascii_letters + string.digits, k=rng.randint(2, 8)))
        if piece not in seen:
            seen.add(piece)
            pieces.append(piece)
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(path)


def run(model_dir: Path, structured: bool, async_scheduling: bool | None, args) -> dict:
    from pagednb import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(str(model_dir), max_model_len=512, max_num_seqs=args.batch, async_scheduling=async_scheduling,
              gpu_memory_utilization=0.5)
    rng = random.Random(1)
    prompts = [[rng.randrange(100, SHAPES[args.shape]["vocab_size"]) for _ in range(32)] for _ in range(args.batch)]
    spec = StructuredOutputsParams(json=SCHEMA) if structured else None
    params = SamplingParams(temperature=0, max_tokens=args.steps, structured_outputs=spec)
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up (and the grammar compiled once)
    best = None
    for _ in range(3):
        before = llm.stats()["steps"]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        steps = llm.stats()["steps"] - before
        if best is None or wall / steps < best["step_ms"] / 1e3:
            best = {"structured": structured, "async_scheduling": async_scheduling, "wall_s": wall, "steps": steps,
                    "step_ms": wall / steps * 1e3,
                    "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}
    llm.close()
    return best


def host_grammar_work(model_dir: Path, batch: int, repeats: int = 20) -> dict:
    """Milliseconds of host work per step for `batch` matchers inside the schema's string (the state the
    timed runs sit in): filling their bitmask rows one matcher at a time (issue 16's first version), with
    GrammarCache.fill_bitmask (xgrammar's batched fill on one thread, used now, on the grammar thread) and with
    xgrammar's own thread pool; accepting a token one call per matcher (used) and with batch_accept_token."""
    import json

    import xgrammar as xgr
    from transformers import AutoTokenizer

    from pagednb import StructuredOutputsParams
    from pagednb.engine.structured_output import GrammarCache

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cache = GrammarCache(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    states = [cache.new_state(StructuredOutputsParams(json=json.dumps(SCHEMA))) for _ in range(batch)]
    opening = tokenizer.convert_tokens_to_ids(list('{"text":"'))
    for token in opening:
        assert all(state.accept(token) for state in states)
    letter = tokenizer.convert_tokens_to_ids("a")
    bitmask = cache.allocate_bitmask(batch)
    rows = list(range(batch))

    def per_step_ms(fn) -> float:
        """The best of five rounds' mean (a shared host's other work only ever adds time)."""
        rounds = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(repeats):
                fn()
            rounds.append((time.perf_counter() - t0) / repeats * 1e3)
        return min(rounds)

    matchers = [state.matcher for state in states]
    one_by_one_accept = per_step_ms(lambda: [state.accept(letter) for state in states])
    batched_accept = per_step_ms(lambda: xgr.BatchGrammarMatcher.batch_accept_token(matchers, [letter] * batch))
    pool = xgr.BatchGrammarMatcher("auto")
    return {"fill_one_by_one_ms": per_step_ms(lambda: [s.matcher.fill_next_token_bitmask(bitmask, i)
                                                       for i, s in enumerate(states)]),
            "fill_batched_ms": per_step_ms(lambda: cache.fill_bitmask(bitmask, matchers, rows)),
            "fill_batched_thread_pool_ms": per_step_ms(
                lambda: pool.batch_fill_next_token_bitmask(matchers, bitmask, rows)),
            "accept_one_by_one_ms": one_by_one_accept, "accept_batched_ms": batched_accept}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-0.6b" if torch.cuda.is_available() else "tiny", choices=SHAPES)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(args.shape, Path(tmp))
        character_tokenizer(model_dir, SHAPES[args.shape]["vocab_size"])
        host = host_grammar_work(model_dir, args.batch)
        print("host grammar work per step at batch {}: {}".format(
            args.batch, ", ".join(f"{k} {v:.3f}" for k, v in host.items())))
        runs = {"plain": run(model_dir, False, None, args),
                "plain, synchronous": run(model_dir, False, False, args),
                "json schema": run(model_dir, True, None, args),
                "json schema, synchronous": run(model_dir, True, False, args)}
    base, sync = runs["plain"]["step_ms"], runs["plain, synchronous"]["step_ms"]
    rows = [[name, r["steps"], r["output_tokens"], r["step_ms"], r["step_ms"] / base - 1, r["step_ms"] / sync - 1]
            for name, r in runs.items()]
    print_table(["run", "steps", "output tokens", "ms/step", "added vs plain", "added vs sync"], rows)
    added = runs["json schema"]["step_ms"] / base - 1
    print(f"JSON-schema bitmask adds {added:.1%} to the step time (target < 10%)")
    path = save(f"structured_output_{args.shape}", {"shape": args.shape, "batch": args.batch, "runs": runs,
                                                    "added_fraction": added, "host_grammar_work": host})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
