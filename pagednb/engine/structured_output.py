"""Structured output: grammars (JSON schema, regex, choice, EBNF) that constrain each sampled token.

xgrammar (the grammar engine vLLM and SGLang use) does the grammar work; this module wires it in:
- one GrammarCompiler per engine, built from the HF tokenizer with the *model's* vocabulary size (the
  logits may be wider than the tokenizer; the extra ids are never allowed);
- compiled grammars cached in an LRU keyed by the spec, so a batch of requests with one schema compiles
  it once;
- one GrammarMatcher per request (`StructuredState`): a token it rejects ends that request alone with
  "error"; EOS is in the bitmask only when the matcher can terminate (xgrammar's stop tokens are the
  model's EOS ids); the request finishes ("stop") once the matcher is terminated.

The step: a matcher needs step N's token before it can fill its row of step N+1's bitmask, so a request with a
grammar runs synchronous steps (Request.needs_output_history, as penalties do): N's tokens reach the matchers,
then N+1 is launched and its rows are filled (xgrammar's batched C++ fill, one thread) while its forward runs,
right before its sampling is queued. Measured at batch 64 on the H200 (benchmarks/structured_output.py):
that costs 1.5% over a synchronous plain step, less than keeping the steps asynchronous and deferring each
step's sampling until its matchers catch up did (the grammar work then lands on the host's critical path
anyway, plus its hand-offs: benchmarks/NOTES.md, issue 16's fourth round).

On the device the bitmask is applied to the logits in the model's dtype by one kernel (`mask_disallowed`; in
place unless the step's logprobs need the raw logits): no float32 copy just for the mask, and greedy rows take
their argmax from it.
"""
from __future__ import annotations

import collections
import functools
import json

import torch

from pagednb.engine.sampling_kernel import mask_logits_
from pagednb.sampling_params import StructuredOutputsParams

# Free whitespace in JSON is allowed (vLLM's default) but each run is at most this many characters: an
# unbounded run lets a small or unsure model emit newlines until max_tokens, and the output never parses
# (vLLM leaves it unbounded; its users set disable_any_whitespace instead).
MAX_WHITESPACE_RUN = 4
_INSTALL_HINT = 'structured output needs xgrammar: pip install "pagednb[structured]"'
_ALL_ALLOWED = -1  # an int32 bitmask word with every bit set


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

    def fill_bitmask(self, bitmask: torch.Tensor, states: list[StructuredState], rows: list[int]) -> None:
        """bitmask[rows[i]] = what states[i] allows next, every other row all-allowed; one batched xgrammar
        call (C++, the GIL released) instead of one Python call per matcher."""
        if len(rows) < bitmask.shape[0]:
            plain = torch.ones(bitmask.shape[0], dtype=torch.bool)
            plain[rows] = False
            bitmask[plain] = _ALL_ALLOWED
        self._batch.batch_fill_next_token_bitmask([s.matcher for s in states], bitmask, rows)


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
