"""Structured output: grammars (JSON schema, regex, choice, EBNF) that constrain each sampled token.

xgrammar (the grammar engine vLLM and SGLang use) does the grammar work; this module wires it in:
- one GrammarCompiler per engine, built from the HF tokenizer with the *model's* vocabulary size (the
  logits may be wider than the tokenizer; the extra ids are never allowed);
- compiled grammars cached in an LRU keyed by the spec, so a batch of requests with one schema compiles
  it once;
- one GrammarMatcher per request (`StructuredState`): a token it rejects ends that request alone with
  "error"; EOS is in the bitmask only when the matcher can terminate (xgrammar's stop tokens are the
  model's EOS ids); the request finishes ("stop") once the matcher is terminated.

The step: the model runner launches the forward first, then fills the bitmask rows of the structured
requests on the CPU (xgrammar's C++ fill) while the device runs that forward; the sampler applies the
bitmask to the float32 logits on the device (xgrammar.apply_token_bitmask_inplace, CPU and CUDA). A
matcher needs each sampled token before the next bitmask, so a structured request turns asynchronous
scheduling off while it runs (Request.needs_output_history), as penalties do.
"""
from __future__ import annotations

import collections
import json
from dataclasses import dataclass

import torch

from pagednb.sampling_params import StructuredOutputsParams

# Free whitespace in JSON is allowed (vLLM's default) but each run is at most this many characters: an
# unbounded run lets a small or unsure model emit newlines until max_tokens, and the output never parses
# (vLLM leaves it unbounded; its users set disable_any_whitespace instead).
MAX_WHITESPACE_RUN = 4
_INSTALL_HINT = 'structured output needs xgrammar: pip install "pagednb[structured]"'


def import_xgrammar():
    """xgrammar, or an ImportError that says how to get it (it is an optional extra)."""
    try:
        import xgrammar
    except ImportError as error:
        raise ImportError(_INSTALL_HINT) from error
    return xgrammar


class StructuredState:
    """One request's grammar matcher: advances with each accepted token, fills its bitmask row."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """False when the grammar rejects the token (the request then ends with "error")."""
        return self.matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


class GrammarCache:
    """Compiles specs with one xgrammar compiler and keeps the most recent `capacity` results."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], capacity: int = 128) -> None:
        xgr = import_xgrammar()
        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids)
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # our LRU caches; one place to bound
        self.vocab_size = vocab_size
        self.capacity = capacity
        self._compiled: collections.OrderedDict = collections.OrderedDict()
        self.num_compiled = 0  # compilations done (cache misses); tests read it

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

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        apply_grammar_bitmask(logits, bitmask, rows)


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits[r] = -inf where bitmask[r] has a 0 bit, for r in rows; in place, on logits' device (float32).
    xgrammar's kernels: C++ on the CPU, Triton on a GPU (its plain-torch version where Triton is missing)."""
    xgr = import_xgrammar()
    try:
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)
    except ImportError:  # no Triton
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows,
                                        backend="torch_native")


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar that matches exactly one of the strings (JSON escapes are EBNF escapes too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@dataclass
class GrammarBitmask:
    """One step's bitmask over the n sampled rows; rows without a grammar are left as they are."""

    bitmask: torch.Tensor  # [n, ceil(V / 32)] int32 on the sampler's device; only `rows` are filled
    rows: list[int]  # the sampled rows with a grammar
