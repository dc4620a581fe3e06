"""`python -m pagednb "prompt"`: stream a reply in the terminal.

Uses the chat template when the model has one, so a plain question gets an assistant's answer.
"""
from __future__ import annotations

import argparse
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pagednb", description=__doc__.splitlines()[0])
    parser.add_argument("prompt", help="what to ask")
    parser.add_argument("--model", default=None, help="local model folder or hub id (default: the embedded model)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    parser.add_argument("--device", default="auto")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pagednb import LLM, SamplingParams
    from pagednb.chat_template import apply_chat_template, has_chat_template

    llm = LLM(args.model)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                            max_tokens=args.max_tokens)
    tokenizer = llm.get_tokenizer()
    prompt: str | dict = args.prompt
    if not args.raw and has_chat_template(tokenizer):
        prompt = {"prompt_token_ids": apply_chat_template(tokenizer, [{"role": "user", "content": args.prompt}])}
    engine = llm.engine
    request_id = engine.add_request(None, prompt, params)
    start, final = time.perf_counter(), None
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == request_id:
                    sys.stdout.write(out.outputs[0].delta)
                    sys.stdout.flush()
                    final = out
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        engine.step()
        print("\n[cancelled]", file=sys.stderr)
        return 130
    elapsed = time.perf_counter() - start
    n = len(final.outputs[0].token_ids)
    print(f"\n[{n} tokens in {elapsed:.2f} s, {n / elapsed:.1f} tok/s, finish_reason={final.outputs[0].finish_reason}]",
          file=sys.stderr)
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
