"""`python -m pagednb "prompt"`: stream a reply in the terminal.

Uses the chat template when the model has one, so a plain question gets an assistant's answer.
`python -m pagednb serve [MODEL] [--host --port --api-key --served-model-name --max-model-len ...]`
serves the model over OpenAI's API instead (pagednb/serving/), until Ctrl-C.
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
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
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


def parse_serve_args(argv: list[str]) -> argparse.Namespace:
    """The server's options, and every LLM option as --kebab-case (--max-model-len 4096), as vLLM's."""
    import dataclasses

    from pagednb.config import EngineConfig

    parser = argparse.ArgumentParser(prog="python -m pagednb serve", description="Serve a model over OpenAI's API.")
    parser.add_argument("model", nargs="?", default=None, help="local folder or hub id (default: the embedded model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="clients must send 'Authorization: Bearer <key>'")
    parser.add_argument("--served-model-name", default=None, help="the model name clients ask for (default: MODEL)")
    engine = parser.add_argument_group("engine options (LLM's keyword arguments)")
    for field in dataclasses.fields(EngineConfig):
        if field.name == "model":
            continue
        kind = str(field.type)
        flag = "--" + field.name.replace("_", "-")
        if "bool" in kind:
            engine.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            engine.add_argument(flag, type=int if "int" in kind else float if "float" in kind else str, default=None)
    args = parser.parse_args(argv)
    args.engine_options = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
                           if f.name != "model" and getattr(args, f.name) is not None}
    return args


def serve(argv: list[str]) -> int:
    import asyncio

    from pagednb import LLM
    from pagednb.serving.server import Server

    args = parse_serve_args(argv)
    llm = LLM(args.model, **args.engine_options)
    server = Server(llm, args.host, args.port, args.api_key, args.served_model_name)
    print(f"[pagednb] Serving {server.model_name!r} at {server.url} (Ctrl-C stops)", file=sys.stderr, flush=True)
    try:
        asyncio.run(server.serve_forever())
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down for, once it has
        pass
    finally:
        llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
