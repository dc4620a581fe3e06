"""Turns one step's logits into next tokens: penalties, masking, temperature, top-k/p, min-p.

Everything is a batched tensor op over the sampled rows; Python loops only touch rows that need
their own state (seeded rows draw from their own generator so their tokens do not depend on the
batch they land in). An all-greedy batch with nothing else to do is one argmax kernel.

Isolation: one row's numbers never reach another row, and never an out-of-range index. A row whose
final logits have no valid distribution (NaN or +inf anywhere, which a huge temperature divisor or a
repetition penalty of 1e-40 produces as easily as a broken model, or every token masked) gets
INVALID_TOKEN_ID instead of a token, in the same tensor the runner copies to the host anyway: the flag
costs no extra synchronisation, and the engine ends that request alone. Filters always keep a row's top
token (a top_p that underflows to 0 is greedy), banned ids outside the vocabulary are skipped, and
counts (top_k, logprobs) are clamped to the vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagednb.engine.logprobs import PromptLogprobs, num_logprobs, token_logprobs
from pagednb.engine.logits_processors import LogitsAdjustments, apply_logits_adjustments
from pagednb.engine.pinned_stager import PinnedStager
from pagednb.engine.sampling_kernel import greedy, sample_with_temperature
from pagednb.engine.structured_output import mask_disallowed
from pagednb.sampling_params import SamplingParams

# In SamplerOutput.token_ids: the row had no valid distribution (see the module docstring). Every other id
# is in [0, V). Device code that feeds sampled ids back into the model clamps this to 0 first.
INVALID_TOKEN_ID = -1


@dataclass
class Penalties:
    """Where penalties land, as flat positions (row * V + token) into the [n, V] logits.

    Only the handful of tokens a request has seen are touched, not its whole vocabulary row.
    """

    seen: torch.Tensor  # [s] each token of prompt + output once (rows with a repetition penalty)
    repetition: torch.Tensor  # [s] that row's repetition penalty
    occurrences: torch.Tensor  # [o] each output token, repeats included (frequency penalty)
    frequency: torch.Tensor  # [o]
    present: torch.Tensor  # [q] each output token once (presence penalty)
    presence: torch.Tensor  # [q]


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs; row i is the i-th sampled request.

    Tensors for optional features are None when no row uses them, so the sampler can skip them.
    Random-sampling fields index the m random rows; top_k/top_p index the f of those that filter.
    """

    random_rows: torch.Tensor | None  # [m] int64; None when all rows are random or all greedy
    num_random: int
    temperature: torch.Tensor | None  # [m, 1]
    filter_rows: torch.Tensor | None  # [f] random rows using top-k/top-p; None when all are
    top_k: torch.Tensor | None  # [f] int64, V where off; None when no row filters
    top_k_max: int  # the largest of top_k, known on the host (reading it back would stall the step)
    top_p: torch.Tensor | None  # [f] float32, 1.0 where off
    min_p: torch.Tensor | None  # [m]
    generator: torch.Generator | None  # shared by random rows without their own
    seeded: list[tuple[int, torch.Generator]]  # (index among random rows, its generator)
    penalties: Penalties | None
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) forced to -inf
    max_num_logprobs: int | None  # None when no row wants logprobs
    # logit_bias, allowed_token_ids, bad_words (set by the runner; engine/logits_processors.py)
    adjustments: LogitsAdjustments | None = None
    # [n, ceil(V / 32)] int32 grammar bitmask, rows without a grammar all ones (engine/structured_output.py)
    grammar_bitmask: torch.Tensor | None = None

    @property
    def all_greedy(self) -> bool:
        return self.num_random == 0

    @property
    def is_plain_greedy(self) -> bool:
        """True when argmax of the raw logits is the whole answer."""
        return (self.all_greedy and self.penalties is None and self.banned is None
                and self.max_num_logprobs is None and self.adjustments is None)

    @property
    def is_plain_random(self) -> bool:
        """True when every row is a plain temperature draw (no penalties, masks, logprobs, filters or
        greedy rows): the sampling kernel's whole case, which reads the logits in the model's dtype."""
        return (self.random_rows is None and not self.all_greedy and self.top_k is None and self.min_p is None
                and self.penalties is None and self.banned is None and self.max_num_logprobs is None
                and self.adjustments is None)

    @classmethod
    def build(cls, params: list[SamplingParams], generators: list[torch.Generator | None],
              prompt_token_ids: list[list[int]], output_token_ids: list[list[int]],
              vocab_size: int, device: torch.device, eos_token_ids: list[int] | None = None,
              generator: torch.Generator | None = None, stager: PinnedStager | None = None
              ) -> SamplingMetadata:
        """`generators[i]` is request i's own generator (required when it has a seed). With a stager the
        tensors reach the device asynchronously (see PinnedStager)."""
        n = len(params)
        _index, _floats = _makers(stager)
        random_idx = [i for i, p in enumerate(params) if not p.is_greedy]
        m = len(random_idx)
        rnd = [params[i] for i in random_idx]
        seeded = []
        for j, i in enumerate(random_idx):
            if generators[i] is not None:
                seeded.append((j, generators[i]))
            elif params[i].seed is not None:
                raise ValueError(f"row {i} has seed {params[i].seed} but no generator")
        filtering = [j for j, p in enumerate(rnd) if p.top_k > 0 or p.top_p < 1.0]
        filters = [rnd[j] for j in filtering]
        top_k = [_count(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in filters]
        logprobs = [num_logprobs(p.logprobs, vocab_size) for p in params if p.logprobs is not None]
        return cls(
            random_rows=_index(random_idx, device) if 0 < m < n else None,
            num_random=m,
            temperature=_floats([p.temperature for p in rnd], device).unsqueeze(1) if m else None,
            filter_rows=_index(filtering, device) if 0 < len(filtering) < m else None,
            top_k=_index(top_k, device) if filters else None,
            top_k_max=max(top_k, default=0),
            top_p=_floats([p.top_p for p in filters], device) if filters else None,
            min_p=(_floats([p.min_p for p in rnd], device)
                   if any(p.min_p > 0.0 for p in rnd) else None),
            generator=generator,
            seeded=seeded,
            penalties=_build_penalties(params, prompt_token_ids, output_token_ids, vocab_size,
                                       device, stager),
            banned=_build_banned(params, output_token_ids, eos_token_ids or [], vocab_size, device, stager),
            max_num_logprobs=max(logprobs) if logprobs else None,
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [n] int64 in [0, V), or INVALID_TOKEN_ID where the row had no valid distribution
    logprobs: torch.Tensor | None  # [n] float32, log-softmax of the raw logits at token_ids
    top_logprobs: torch.Tensor | None  # [n, k_max], descending
    top_token_ids: torch.Tensor | None  # [n, k_max]
    ranks: torch.Tensor | None = None  # [n] int64, the sampled token's rank in the vocabulary (1 = most likely)
    prompt_logprobs: PromptLogprobs | None = None  # set by the runner in steps with prompt-logprob rows


class Sampler(torch.nn.Module):
    """Order: grammar bitmask, allowed_token_ids, bad_words, logit_bias, penalties, min_tokens masking, then
    greedy argmax or temperature/top-k/top-p/min-p."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """`logits` is [n, V] in the model's dtype or float32; only a grammar bitmask changes it (in place,
        when no logprobs are asked for: nothing reads the raw logits then). Greedy argmax and the temperature
        kernel read it as it is (or grammar-masked, in the same dtype); everything else works on its (exact)
        float32 copy."""
        raw = logits
        if metadata.grammar_bitmask is not None:  # first, as vLLM; logprobs stay the raw ones
            logits = mask_disallowed(logits, metadata.grammar_bitmask, in_place=metadata.max_num_logprobs is None)
        if metadata.is_plain_greedy:
            return SamplerOutput(_greedy(logits), None, None, None)
        if not metadata.is_plain_random:
            masked = logits is not raw
            logits = logits.float()
            if not masked:
                raw = logits
        if metadata.adjustments is not None:  # before penalties, as vLLM
            logits = apply_logits_adjustments(logits.clone() if logits is raw else logits, metadata.adjustments)
        logits = apply_penalties(logits, metadata.penalties)
        if metadata.banned is not None:
            if logits is raw:
                logits = logits.clone()
            logits[metadata.banned] = float("-inf")
        token_ids = _sample(logits, metadata)
        return _with_logprobs(raw, token_ids, metadata.max_num_logprobs)


def _sample(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    if md.all_greedy:
        return _greedy(logits)
    if md.random_rows is None:  # all rows random
        return _sample_random(logits, md)
    token_ids = _greedy(logits)
    token_ids[md.random_rows] = _sample_random(logits[md.random_rows], md)
    return token_ids


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    """Argmax per row, INVALID_TOKEN_ID where the row's max is not finite: one kernel on the GPU
    (sampling_kernel.greedy), else torch, where max() propagates NaN, so the row's max alone tells NaN,
    +inf and all -inf rows apart from good ones, in the same pass as argmax."""
    token_ids = greedy(logits)
    if token_ids is not None:
        return token_ids
    top, token_ids = logits.max(-1)
    return _flag_invalid(token_ids, top)


def _flag_invalid(token_ids: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """token_ids where the row's max logit `top` ([n]) is finite, else INVALID_TOKEN_ID; on the device."""
    return torch.where(top.isfinite(), token_ids, INVALID_TOKEN_ID)


def _sample_random(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Inverse-CDF draw in token-id order: one uniform per row, so a seeded row's token depends
    only on its own logits and generator, never on the batch around it. Temperature alone is one
    fused kernel on the GPU (sampling_kernel.py); the same uniforms serve either path."""
    u = _uniforms(md)
    if md.top_k is None and md.min_p is None:
        token_ids = sample_with_temperature(logits, md.temperature, u)
        if token_ids is not None:
            return token_ids
    logits = logits.float() / md.temperature  # (the float32 copy when the kernel declined bf16/fp16 rows)
    top = logits.amax(-1, keepdim=True)  # NaN if any logit is; +inf after an overflow
    weights = (logits - top).exp_()  # unnormalised; the top token is 1
    if md.top_k is not None:
        weights.masked_fill_(logits < _top_k_top_p_floor(logits, md), 0.0)
    if md.min_p is not None:  # min_p <= 1 keeps the top token
        weights.masked_fill_(weights < md.min_p.unsqueeze(1), 0.0)
    cdf = weights.cumsum_(-1)
    # 1 - u lies in (0, 1], so the target picks a token of nonzero weight and never runs off the end; the
    # clamp only matters for flagged rows, whose NaN target would give V.
    target = (1.0 - u) * cdf[:, -1:]
    token_ids = torch.searchsorted(cdf, target).squeeze(1).clamp_(max=logits.shape[-1] - 1)
    return _flag_invalid(token_ids, top.squeeze(1))


def _uniforms(md: SamplingMetadata) -> torch.Tensor:
    device = md.temperature.device
    u = torch.rand(md.num_random, 1, generator=md.generator, device=device)
    for row, gen in md.seeded:
        u[row] = torch.rand(1, generator=gen, device=device)
    return u


def _top_k_top_p_floor(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """[m, 1] smallest logit each row keeps under top-k, then top-p (-inf for rows without).

    Only the rows that filter are sorted, and only as far as the largest k they ask for; top-p
    runs on unnormalised cumulative weights, so a row's result does not depend on that length.
    """
    rows = logits if md.filter_rows is None else logits[md.filter_rows]
    k_max = md.top_k_max
    if k_max < rows.shape[-1]:
        top = rows.topk(k_max, dim=-1).values
    else:
        top = rows.sort(-1, descending=True).values
    weights = (top - top[:, :1]).exp_()
    weights.masked_fill_(torch.arange(k_max, device=top.device) >= md.top_k.unsqueeze(1), 0.0)
    cum = weights.cumsum(-1)
    keep = ((cum - weights) < md.top_p.unsqueeze(1) * cum[:, -1:]) & (weights > 0)
    # at least the top token: a top_p that underflowed to 0 (or a NaN row, flagged later) keeps one
    floor = top.gather(1, keep.sum(-1, keepdim=True).clamp_(min=1) - 1)
    if md.filter_rows is None:
        return floor
    full = torch.full((logits.shape[0], 1), float("-inf"), device=logits.device)
    return full.index_copy_(0, md.filter_rows, floor)


def apply_penalties(logits: torch.Tensor, pen: Penalties | None) -> torch.Tensor:
    """HF repetition penalty over prompt+output, then OpenAI frequency/presence over output."""
    if pen is None:
        return logits
    logits = logits.clone()
    flat = logits.view(-1)
    seen = flat[pen.seen]
    flat[pen.seen] = torch.where(seen > 0, seen / pen.repetition, seen * pen.repetition)
    flat.index_add_(0, pen.occurrences, pen.frequency, alpha=-1)  # once per occurrence: count * f
    flat.index_add_(0, pen.present, pen.presence, alpha=-1)
    return logits


def _with_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, k_max: int | None) -> SamplerOutput:
    if k_max is None:
        return SamplerOutput(token_ids, None, None, None)
    lp = token_logprobs(raw.float().log_softmax(-1), token_ids, k_max)  # flagged rows: read at token 0, unused
    return SamplerOutput(token_ids, lp.logprobs, lp.top_logprobs, lp.top_token_ids, lp.ranks)


def _build_penalties(params: list[SamplingParams], prompts: list[list[int]],
                     outputs: list[list[int]], vocab: int, device: torch.device,
                     stager: PinnedStager | None = None) -> Penalties | None:
    _index, _floats = _makers(stager)
    seen, repetition, occurrences, frequency, present, presence = [], [], [], [], [], []
    for i, p in enumerate(params):
        if not p.has_penalties:
            continue
        base, out = i * vocab, outputs[i]
        if p.repetition_penalty != 1.0:
            tokens = set(prompts[i]).union(out)
            seen += [base + t for t in tokens]
            repetition += [p.repetition_penalty] * len(tokens)
        if p.frequency_penalty != 0.0:
            occurrences += [base + t for t in out]
            frequency += [p.frequency_penalty] * len(out)
        if p.presence_penalty != 0.0:
            tokens = set(out)
            present += [base + t for t in tokens]
            presence += [p.presence_penalty] * len(tokens)
    if not (repetition or frequency or presence):
        return None
    return Penalties(_index(seen, device), _floats(repetition, device),
                     _index(occurrences, device), _floats(frequency, device),
                     _index(present, device), _floats(presence, device))


def _build_banned(params: list[SamplingParams], outputs: list[list[int]], eos_token_ids: list[int],
                  vocab_size: int, device: torch.device, stager: PinnedStager | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """EOS and stop token ids of rows still short of min_tokens (ids outside the vocabulary are never
    sampled anyway, and indexing with them would fail the whole step)."""
    _index, _ = _makers(stager)
    rows: list[int] = []
    cols: list[int] = []
    for i, p in enumerate(params):
        if len(outputs[i]) < p.min_tokens:
            ids = p.stop_token_ids if p.ignore_eos else [*eos_token_ids, *p.stop_token_ids]
            ids = [t for t in ids if 0 <= t < vocab_size]
            rows += [i] * len(ids)
            cols += ids
    if not rows:
        return None
    return _index(rows, device), _index(cols, device)


def _count(value: float, vocab_size: int) -> int:
    """A per-row count (top_k, logprobs) as the int the tensor ops need, at most the vocabulary size."""
    return int(min(value, vocab_size))


def _makers(stager: PinnedStager | None):
    """(int64 maker, float32 maker), each (values, device) -> tensor, through the stager if any."""
    if stager is None or not stager.enabled:
        return _index_plain, _floats_plain
    return (lambda values, device: stager.tensor(values, torch.int64),
            lambda values, device: stager.tensor(values, torch.float32))


def _index_plain(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _floats_plain(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)
