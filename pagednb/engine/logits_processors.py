"""Per-request logits processors: logit_bias, allowed_token_ids, bad_words and structured output.

Three stages, each where its data is:
- `prepare` (add time, engine thread): checks token ids against the model's vocabulary, tokenizes the
  bad words and compiles the grammar (a bad one raises ValueError naming its field, nothing queued);
  the result lives on the request (`Request.logits_state`).
- each step, on the host while the device runs the forward: `build` gives one `LogitsAdjustments` of
  flat positions and values for the sampled rows (None when no row uses any, so the sampler's plain
  paths stay as they are); a step with grammar rows defers its sampling until `start_grammar_bitmask`
  has filled them, after the matchers took the previous step's tokens (engine/structured_output.py).
- on the device, in the sampler: the grammar bitmask first (in the model's dtype, one kernel), then
  `apply_logits_adjustments` (float32): allowed ids, bad words, bias, in vLLM's order (all before
  penalties; logprobs stay those of the raw logits, vLLM's default).

bad_words follows vLLM: each word is tokenized as is and with a leading space, and a word's last token
is banned when the output so far ends with the rest of its tokens (a one-token word is always banned).
One difference: vLLM keeps the spaced form only when it has as many tokens as the plain one; pagednb
keeps it whenever it differs, so " word" is banned too where the tokenizer splits "word" differently
(vLLM would let it through). This reads the output, so
like penalties it needs each token on the host before the next step (Request.needs_output_history).
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from pagednb.engine.pinned_stager import PinnedStager
from pagednb.engine.structured_output import ALL_ALLOWED, GrammarCache, StructuredState
from pagednb.request import Request


@dataclass
class RequestLogitsState:
    """What a request's logits processors need beyond its SamplingParams, prepared once at add time."""

    bad_words_token_ids: list[list[int]]
    structured: StructuredState | None


@dataclass
class PendingBitmask:
    """A step's grammar bitmask on the host, being filled on the grammar thread when `fill` is set."""

    host: torch.Tensor
    fill: Future | None


@dataclass
class LogitsAdjustments:
    """One step's masks and biases over the [n, V] logits; a field is None when no row uses it."""

    allowed_rows: torch.Tensor | None  # [a] rows restricted to allowed_token_ids
    allowed_positions: torch.Tensor | None  # flat positions into the [a, V] mask of those rows
    banned_positions: torch.Tensor | None  # flat positions (row * V + token) forced to -inf (bad words)
    bias_positions: torch.Tensor | None  # flat positions that get a logit_bias
    bias_values: torch.Tensor | None


class LogitsProcessors:
    """Prepares requests, builds each step's adjustments, and advances grammar matchers."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.grammars: GrammarCache | None = None  # built at the first structured request (xgrammar is optional)
        # queued requests, pruned each step: those with logit_bias / allowed_token_ids / bad_words, and
        # those with a grammar (a request may be in both)
        self._adjusted: dict[str, Request] = {}
        self._structured: dict[str, Request] = {}
        self._pinned: torch.Tensor | None = None  # host bitmask, reused once its last copy is done
        self._copied: torch.cuda.Event | None = None  # recorded after the pinned bitmask's last copy

    # ---- add time -----------------------------------------------------------------------------------
    def prepare(self, req: Request) -> None:
        """Checks req's processor parameters against the model and sets req.logits_state (ValueError)."""
        params = req.sampling_params
        if not params.uses_logits_processors:
            return
        vocab = self.vocab_size
        checked = (("logit_bias", list(params.logit_bias or ())), ("allowed_token_ids", params.allowed_token_ids or []))
        for field, ids in checked:
            outside = [t for t in ids if t >= vocab]
            if outside:
                raise ValueError(f"{field} has token id {outside[0]}, outside the vocabulary [0, {vocab})")
        structured = None
        if params.structured_outputs is not None:
            if self.grammars is None:
                self.grammars = GrammarCache(self.tokenizer, vocab, self.eos_token_ids)
            structured = self.grammars.new_state(params.structured_outputs)
        req.logits_state = RequestLogitsState(self._bad_words_token_ids(params.bad_words or []), structured)

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        sequences: list[list[int]] = []
        for word in words:
            plain = self._encode(word.lstrip())
            if plain:
                sequences.append(plain)
            spaced = self._encode(" " + word.lstrip())
            if spaced and spaced != plain:
                sequences.append(spaced)
        return [s for s in sequences if all(t < self.vocab_size for t in s)]

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def register(self, req: Request) -> None:
        """Called when req is queued; from then on steps build its adjustments / bitmask rows while it lives."""
        params = req.sampling_params
        if params.logit_bias or params.allowed_token_ids is not None or params.bad_words:
            self._adjusted[req.request_id] = req
        if params.structured_outputs is not None:
            self._structured[req.request_id] = req

    @property
    def active(self) -> bool:
        """Whether any queued request has logit_bias, allowed_token_ids or bad_words (else `build` is never
        called: no per-step cost)."""
        return bool(self._adjusted)

    @property
    def has_grammars(self) -> bool:
        """Whether any queued request has a grammar (its steps' sampling waits for the matchers)."""
        return bool(self._structured)

    # ---- each step ----------------------------------------------------------------------------------
    def build(self, reqs: list[Request], vocab_size: int, device: torch.device,
              stager: PinnedStager | None = None) -> LogitsAdjustments | None:
        """The step's allowed ids, bad words and biases for the sampled rows `reqs` (grammars: see
        start_grammar_bitmask)."""
        allowed_rows, allowed_pos, banned, bias_pos, bias_val = [], [], [], [], []
        for i, req in enumerate(reqs):
            params, state = req.sampling_params, req.logits_state
            if state is None:
                continue
            base = i * vocab_size
            if params.allowed_token_ids is not None:
                row_base = len(allowed_rows) * vocab_size
                allowed_rows.append(i)
                allowed_pos += [row_base + t for t in params.allowed_token_ids]
            if params.logit_bias:
                bias_pos += [base + t for t in params.logit_bias]
                bias_val += params.logit_bias.values()
            banned += [base + t for t in _banned_last_tokens(state.bad_words_token_ids, req.output_token_ids)]
        if not (allowed_rows or banned or bias_pos):
            return None
        index, floats = _makers(stager, device)
        return LogitsAdjustments(
            allowed_rows=index(allowed_rows) if allowed_rows else None,
            allowed_positions=index(allowed_pos) if allowed_rows else None,
            banned_positions=index(banned) if banned else None,
            bias_positions=index(bias_pos) if bias_pos else None,
            bias_values=floats(bias_val) if bias_pos else None,
        )

    def grammar_rows(self, reqs: list[Request]) -> list[int]:
        """The rows of the sampled `reqs` whose request has a grammar (that step's sampling waits for them)."""
        if not self._structured:
            return []
        return [i for i, req in enumerate(reqs) if req.request_id in self._structured]

    def start_grammar_bitmask(self, reqs: list[Request], rows: list[int], device: torch.device,
                              background: bool) -> PendingBitmask:
        """Starts the [len(reqs), ceil(V / 32)] int32 bitmask of a step: row i = what reqs[i]'s grammar allows
        next, every token for the other rows and for requests finished since the step was launched. Called once
        the matchers have every earlier token; filled on the grammar thread when `background` (xgrammar's
        batched fill), here otherwise; in pinned memory on a GPU, so its copy is queued without waiting."""
        live = [i for i in rows if not reqs[i].is_finished]
        host = self._host_bitmask(len(reqs), device)
        if len(live) < len(reqs):
            everything = np.ones(len(reqs), dtype=bool)
            everything[live] = False
            host.numpy()[everything] = ALL_ALLOWED
        matchers = [reqs[i].logits_state.structured.matcher for i in live]
        if live and background:
            return PendingBitmask(host, self.grammars.fill_in_background(host, matchers, live))
        if live:
            self.grammars.fill_bitmask(host, matchers, live)
        return PendingBitmask(host, None)

    def finish_grammar_bitmask(self, pending: PendingBitmask, device: torch.device) -> torch.Tensor:
        """The started bitmask on device, once filled (a failed fill raises here)."""
        if pending.fill is not None:
            pending.fill.result()
        if device.type != "cuda":
            return pending.host
        on_device = pending.host.to(device, non_blocking=True)
        self._copied.record()
        return on_device

    def _host_bitmask(self, num_rows: int, device: torch.device) -> torch.Tensor:
        """Host rows to fill: pinned and reused on a GPU (after its previous copy is done: queued before the
        previous step's sampling, whose tokens the matchers have by now, so this never waits in practice),
        fresh on the CPU (the sampler reads it)."""
        if device.type != "cuda":
            return self.grammars.allocate_bitmask(num_rows)
        if self._pinned is None or self._pinned.shape[0] < num_rows:
            self._pinned = torch.empty((max(num_rows, 64), self.grammars.bitmask_width), dtype=torch.int32,
                                       pin_memory=True)
            self._copied = torch.cuda.Event()  # (an event never recorded: synchronize returns at once)
        self._copied.synchronize()
        return self._pinned[:num_rows]

    def close(self) -> None:
        if self.grammars is not None:
            self.grammars.close()

    def advance(self, progressed: list[Request]) -> tuple[list[Request], list[Request]]:
        """Feeds each progressed grammar request its new token; returns (rejected, terminated) among the
        ones still running, for the engine to end with "error" and "stop". Forgets finished requests.
        Per step at every grammar row: kept lean (a matcher terminates only by accepting a stop token, so
        only those are asked whether it did)."""
        if self._adjusted:
            self._adjusted = {k: r for k, r in self._adjusted.items() if not r.is_finished}
        if not self._structured:
            return [], []
        rejected, terminated = [], []
        stop_ids = self.grammars.stop_token_ids
        for req in progressed:
            state = req.logits_state
            if state is None or state.structured is None or req.is_finished:
                continue
            token = req.output_token_ids[-1]
            if not state.structured.accept(token):
                req.error = ValueError(f"request {req.request_id!r}: token {token} does not follow its "
                                       f"structured_outputs grammar; this request alone ends with 'error'")
                rejected.append(req)
            elif token in stop_ids and state.structured.is_terminated:
                terminated.append(req)
        self._structured = {k: r for k, r in self._structured.items() if not r.is_finished}
        return rejected, terminated


def _makers(stager: PinnedStager | None, device: torch.device):
    """(int64 maker, float32 maker) from lists, through the stager's pinned memory on a GPU."""
    if stager is not None and stager.enabled:
        return (lambda v: stager.tensor(v, torch.int64)), (lambda v: stager.tensor(v, torch.float32))
    return ((lambda v: torch.tensor(v, dtype=torch.int64, device=device)),
            (lambda v: torch.tensor(v, dtype=torch.float32, device=device)))


def _banned_last_tokens(sequences: list[list[int]], output: list[int]) -> list[int]:
    """The last token of each bad word whose other tokens end the output so far."""
    banned = []
    for seq in sequences:
        prefix = len(seq) - 1
        if prefix == 0 or (len(output) >= prefix and output[-prefix:] == seq[:-1]):
            banned.append(seq[-1])
    return banned


def apply_logits_adjustments(logits: torch.Tensor, adj: LogitsAdjustments) -> torch.Tensor:
    """Applies `adj` to the float32 logits in place and returns them (the caller passes a copy)."""
    vocab = logits.shape[-1]
    if adj.allowed_rows is not None:
        keep = torch.zeros(len(adj.allowed_rows), vocab, dtype=torch.bool, device=logits.device)
        keep.view(-1)[adj.allowed_positions] = True
        logits[adj.allowed_rows] = logits[adj.allowed_rows].masked_fill_(~keep, float("-inf"))
    flat = logits.view(-1)
    if adj.banned_positions is not None:
        flat[adj.banned_positions] = float("-inf")
    if adj.bias_positions is not None:
        flat.index_add_(0, adj.bias_positions, adj.bias_values)
    return logits
