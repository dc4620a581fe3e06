"""Structured output: grammars (JSON schema, regex, choice, EBNF) that constrain each sampled token.

xgrammar (the grammar engine vLLM and SGLang use) does the grammar work; this module wires it in:
- one GrammarCompiler per engine, built from the HF tokenizer with the *model's* vocabulary size (the
  logits may be wider than the tokenizer; the extra ids are never allowed);
- compiled grammars cached in an LRU keyed by the spec, so a batch of requests with one schema compiles
  it once;
- one GrammarMatcher per request (`StructuredState`): a token it rejects ends that request alone with
  "error"; EOS is in the bitmask only when the matcher can terminate (xgrammar's stop tokens are the
  model's EOS ids); the request finishes ("stop") once the matcher is terminated.

The step: a matcher needs step N's token before it can fill its row of step N+1's bitmask, yet with
asynchronous scheduling N+1 is launched before N's tokens reach the host. So a step with grammar rows runs its
forward at once and defers its sampling (engine/model_runner.py): once the engine has given the matchers N's
tokens, the rows are filled on a grammar thread (xgrammar's batched C++ fill, which releases the GIL) while the
engine thread builds N's outputs and schedules N+2; N+1's sampling is queued, with the mask, right before N+2's
forward. The fill starts only once the thread is inside the C++ call (`fill_in_background`): a thread that merely
waits for the GIL would get it only when the engine thread blocks, i.e. in series with it (measured at batch 64
on the H200: +23.1% over plain steps that way; benchmarks/NOTES.md, issue 16's fourth and fifth rounds).
On the device the bitmask is applied to the logits in the model's dtype by one kernel (`mask_disallowed`; in
place unless the step's logprobs need the raw logits): no float32 copy just for the mask, and greedy rows take
their argmax from it.
"""
from __future__ import annotations

import collections
import functools
import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pagednb.engine.sampling_kernel import mask_logits_
from pagednb.sampling_params import StructuredOutputsParams

# Free whitespace in JSON is allowed (vLLM's default) but each run is at most this many characters: an
# unbounded run lets a small or unsure model emit newlines until max_tokens, and the output never parses
# (vLLM leaves it unbounded; its users set disable_any_whitespace instead).
MAX_WHITESPACE_RUN = 4
_INSTALL_HINT = 'structured output needs xgrammar: pip install "pagednb[structured]"'
ALL_ALLOWED = -1  # an int32 bitmask word with every bit set


def import_xgrammar():
    """xgrammar, or an ImportError that says how to get it (it is an optional extra)."""
    try:
        import xgrammar
    except ImportError as error:
        raise ImportError(_INSTALL_HINT) from error
    return xgrammar


class StructuredState:
    """One request's grammar matcher: advances with each accepted token (GrammarCache fills bitmask rows
    of many matchers at once)."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """False when the grammar rejects the token (the request then ends with "error"). One call per
        matcher: xgrammar's batched accept measured slower at batch 64 (benchmarks/structured_output.py)."""
        return self.matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class GrammarCache:
    """Compiles specs with one xgrammar compiler and keeps the most recent `capacity` results; fills
    bitmasks of many matchers at once."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], capacity: int = 128) -> None:
        xgr = import_xgrammar()
        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids)
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # our LRU caches; one place to bound
        self.vocab_size = vocab_size
        self.bitmask_width = -(-vocab_size // 32)
        self.capacity = capacity
        self._compiled: collections.OrderedDict = collections.OrderedDict()
        self.num_compiled = 0  # compilations done (cache misses); tests read it
        # xgrammar's batched fill on one thread: at batch 64 on the H200's host 0.26 ms a step, vs 0.73 with its
        # own thread pool ("auto", whose threads also slowed the engine's) and 0.36 one matcher at a time
        # (benchmarks/structured_output.py)
        self._batch = xgr.BatchGrammarMatcher(1)
        self.stop_token_ids = frozenset(eos_token_ids)  # a matcher terminates only by accepting one of these
        self._worker: ThreadPoolExecutor | None = None  # the grammar thread, started at the first background fill

    def new_state(self, params: StructuredOutputsParams) -> StructuredState:
        """A fresh matcher for `params`; a spec that does not compile raises ValueError naming its field."""
        key = params.cache_key()
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compile(params)
            self._compiled[key] = compiled
            if len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return StructuredState(self._xgr.GrammarMatcher(compiled))

    def _compile(self, params: StructuredOutputsParams):
        field, value = params.kind, getattr(params, params.kind)
        compiler = self.compiler
        try:
            if field in ("json", "json_object"):  # json=True and json_object: any JSON object, as vLLM
                schema = '{"type": "object"}' if field == "json_object" or value is True else value
                compiled = compiler.compile_json_schema(schema, any_whitespace=not params.disable_any_whitespace,
                                                        max_whitespace_cnt=MAX_WHITESPACE_RUN)
            elif field == "regex":
                compiled = compiler.compile_regex(value)
            elif field == "choice":
                compiled = compiler.compile_grammar(choice_grammar(value))
            else:
                compiled = compiler.compile_grammar(value)
        except (RuntimeError, ValueError, TypeError) as error:
            reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
            raise ValueError(f"structured_outputs.{field} could not be compiled into a grammar: {reason}") from None
        self.num_compiled += 1
        return compiled

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """[num_rows, ceil(V / 32)] int32 on the CPU, every bit set (all tokens allowed)."""
        return self._xgr.allocate_token_bitmask(num_rows, self.vocab_size)

    def fill_bitmask(self, bitmask: torch.Tensor, matchers: list, rows: list[int]) -> None:
        """bitmask[rows[i]] = what matchers[i] allows next (other rows untouched): one batched xgrammar call
        (C++, the GIL released) instead of one Python call per matcher."""
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)

    def fill_in_background(self, bitmask: torch.Tensor, matchers: list, rows: list[int]) -> Future:
        """fill_bitmask on the grammar thread; returns once that thread is in the call, so the fill runs beside
        the caller's Python rather than after it (the caller holds the GIL until it blocks)."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="pagednb-grammar")
        started = threading.Event()
        future = self._worker.submit(self._fill_once_started, started, bitmask, matchers, rows)
        started.wait()  # blocks, so the GIL is free for the worker to reach the C++ fill
        return future

    def _fill_once_started(self, started: threading.Event, bitmask: torch.Tensor, matchers: list,
                           rows: list[int]) -> None:
        started.set()
        self.fill_bitmask(bitmask, matchers, rows)

    def close(self) -> None:
        """Stops the grammar thread (it holds nothing else)."""
        if self._worker is not None:
            self._worker.shutdown(wait=False)
            self._worker = None


def mask_disallowed(logits: torch.Tensor, bitmask: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """logits ([n, V], any float dtype, any device) with -inf where bitmask ([n, ceil(V / 32)] int32 on the same
    device) has a 0 bit: changed in place when in_place (nothing reads the raw logits afterwards), else a copy.
    On a GPU one kernel (engine/sampling_kernel.mask_logits_), else torch: token t is bit t % 32 of word t // 32;
    read as bytes (little endian, as every host and GPU pagednb runs on), it is bit t % 8 of byte t // 8."""
    out = logits if in_place else logits.clone()
    if mask_logits_(out, bitmask):
        return out
    n, vocab = logits.shape
    blocked = (bitmask.view(torch.uint8).unsqueeze(-1) & _byte_bits(logits.device)) == 0  # [n, 4W, 8]
    return out.masked_fill_(blocked.view(n, -1)[:, :vocab], float("-inf"))


@functools.cache
def _byte_bits(device: torch.device) -> torch.Tensor:
    """[8] uint8: 1, 2, 4, ..., 128 on device (made once per device, not copied to it every step)."""
    return torch.tensor([1 << k for k in range(8)], dtype=torch.uint8, device=device)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar that matches exactly one of the strings (JSON escapes are EBNF escapes too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
