"""From requests that advanced to RequestOutputs: record logprobs, detokenize incrementally, find stop
strings."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagednb.engine.detokenizer import IncrementalDetokenizer
from pagednb.engine.parallel_sampling import ParentRegistry, ParentRequest
from pagednb.engine.logprobs import PromptLogprobs, num_logprobs
from pagednb.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from pagednb.request import Request, RequestStatus
from pagednb.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from pagednb.engine.sampler import SamplerOutput
    from pagednb.engine.scheduler import SchedulerOutput

# Ends the requests whose text reached a stop string, each with that string, before their outputs are built.
StopHandler = Callable[[list[tuple[Request, str]]], None]


@dataclass
class _Tracked:
    detokenizer: IncrementalDetokenizer
    num_detokenized: int = 0  # output tokens already fed to the detokenizer
    num_sent: int = 0  # output tokens already handed out (for DELTA outputs)
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # [None, position 1, ...] as they arrive
    prompt_logprobs_sent: bool = False  # (DELTA outputs carry them once, in the first output)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._tracked: dict[str, _Tracked] = {}
        self.parents = ParentRegistry()  # n > 1 requests in flight (engine/parallel_sampling.py)
        self._pieces: dict[int, str] = {}  # token id -> its decoded text, for Logprob.decoded_token
        # The requests (or n > 1 parents) whose consumer has not taken its last output yet: no output is
        # built for them but their final one. Building one every step for a consumer that reads every few
        # steps (the HTTP server's paced chunks) costs the host more than a GPU step at hundreds of
        # streams; their tokens wait instead, and the next output built carries them all. Consumers add
        # and discard ids from any thread (one set operation, atomic); engine/driver.py explains who.
        self.held_ids: set[str] = set()

    def add_request(self, req: Request | ParentRequest) -> None:
        if isinstance(req, ParentRequest):  # n > 1: each child is tracked, the parent gathers them
            self.parents.add(req)
            for child in req.children:
                self.add_request(child)
            return
        self._tracked[req.request_id] = tracked = _Tracked(
            IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.sampling_params))
        if req.sampling_params.prompt_logprobs is not None:
            tracked.prompt_logprobs = [None]

    def process(self, reqs: list[Request], finish_stopped: StopHandler | None = None,
                error: BaseException | None = None) -> list[RequestOutput]:
        """The outputs of requests that advanced or ended, their new tokens detokenized.

        A stop string is found here, in the text, but ending its request is the scheduler's business:
        `finish_stopped` (the engine's) does it before the outputs are built, so they are final. Only
        running (or just length-capped) requests can stop so: aborted or failed ones need no handler.
        """
        stopped = self._detokenize(reqs)
        if stopped:
            finish_stopped(stopped)
        return self._make_outputs(reqs, error)

    def record_logprobs(self, progressed: list[Request], out: SamplerOutput | None, sched: SchedulerOutput) -> None:
        """Stores the sampled token's logprob and rank (and the top-k) on each request that asked for
        them, and the step's prompt logprobs (engine/logprobs.py)."""
        if out is None:
            return
        if out.prompt_logprobs is not None:
            self._record_prompt_logprobs(out.prompt_logprobs)
        if out.logprobs is None:
            return
        values, ranks = out.logprobs.tolist(), out.ranks.tolist()
        top_vals = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        top_ids = out.top_token_ids.tolist() if out.top_token_ids is not None else None
        row_of = {s.request.request_id: i for i, s in enumerate(s for s in sched.scheduled if s.samples)}
        for req in progressed:
            i = row_of[req.request_id]  # its row among the step's sampled rows (dropped tokens leave gaps)
            k = req.sampling_params.logprobs
            if k is None or req.error is not None:  # asked for none, or its sampling failed: no token
                continue
            token_id = req.output_token_ids[-1]
            req.logprobs.append(self._position_logprobs(
                req, token_id, values[i], ranks[i], top_ids[i] if top_ids else [], top_vals[i] if top_vals else [], k))
            req.cumulative_logprob += values[i]

    def _record_prompt_logprobs(self, prompt: PromptLogprobs) -> None:
        """Appends each span's positions to its request's prompt logprobs; positions already there (a
        preempted request computes its prompt again) are skipped."""
        v = prompt.values
        values, ranks = v.logprobs.tolist(), v.ranks.tolist()
        top_vals = v.top_logprobs.tolist() if v.top_logprobs is not None else None
        top_ids = v.top_token_ids.tolist() if v.top_token_ids is not None else None
        for span in prompt.spans:
            req = span.request
            tracked = self._tracked.get(req.request_id)
            if tracked is None or tracked.prompt_logprobs is None:
                continue
            k = req.sampling_params.prompt_logprobs
            recorded = tracked.prompt_logprobs
            for j in range(len(recorded) - span.first_position, span.count):
                r = span.row_start + j
                recorded.append(self._position_logprobs(
                    req, req.prompt_token_ids[span.first_position + j], values[r], ranks[r],
                    top_ids[r] if top_ids else [], top_vals[r] if top_vals else [], k))

    def _position_logprobs(self, req: Request, token_id: int, logprob: float, rank: int,
                           top_ids: list[int], top_vals: list[float], k: int) -> PositionLogprobs:
        """{token_id: Logprob} for the chosen token, then the top-k (ranks 1..k), as vLLM orders them."""
        decode = self._piece if req.sampling_params.detokenize else _no_text
        entry = {token_id: Logprob(logprob, rank, decode(token_id))}
        k = num_logprobs(k, len(top_ids)) if top_ids else 0
        for r, (t, value) in enumerate(zip(top_ids[:k], top_vals[:k]), start=1):
            entry[t] = Logprob(value, r, decode(t))
        return entry

    def _piece(self, token_id: int) -> str:
        """The token's own text, tokenizer.decode([token_id]) (as vLLM's logprobs detokenizer), cached."""
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self.tokenizer.decode([token_id])
        return piece

    def _detokenize(self, reqs: list[Request]) -> list[tuple[Request, str]]:
        """Feeds new tokens to each request's detokenizer; returns (request, stop string) for requests
        whose text now contains a stop string: they end as stopped, also when the same token reached
        max_tokens (the stop string wins, as in vLLM)."""
        stopped, held = [], self.held_ids
        for req in reqs:
            tracked = self._tracked[req.request_id]
            detokenizer = tracked.detokenizer
            if not req.is_finished and (detokenizer.defers_until_finished or (
                    held and not detokenizer.finds_stop_strings and self._is_held(req))):
                continue  # decoded later, with the tokens since (a stop string must be found at once)
            new_tokens = req.output_token_ids[tracked.num_detokenized:]
            if len(new_tokens) > 1 and detokenizer.finds_stop_strings:  # accepted drafts: several at once
                stop = _update_until_stop(req, detokenizer, new_tokens)
            else:
                stop = detokenizer.update(new_tokens, finished=req.is_finished)
            tracked.num_detokenized = req.num_output_tokens
            if stop is not None and req.status in (RequestStatus.RUNNING, RequestStatus.FINISHED_LENGTH_CAPPED):
                stopped.append((req, stop))
        return stopped

    def _make_outputs(self, reqs: list[Request], error: BaseException | None = None) -> list[RequestOutput]:
        outputs = []
        final_only, held = RequestOutputKind.FINAL_ONLY, self.held_ids
        parents = self.parents if self.parents else None  # None without n > 1 requests: no lookups
        touched: dict[str, ParentRequest] | None = None
        for req in reqs:
            if not req.is_finished and (req.sampling_params.output_kind is final_only or (held and self._is_held(req))):
                continue
            out = self._make_output(req, error if error is not None else req.error)
            if req.is_finished:
                del self._tracked[req.request_id]
                held.discard(req.request_id)
            parent = parents.parent_of(req.request_id) if parents is not None else None
            if parent is None:
                outputs.append(out)
            else:  # a child of an n > 1 request: gathered into its parent's output below
                parent.record(out)
                touched = touched if touched is not None else {}
                touched[parent.request_id] = parent
        if touched is not None:
            outputs += self._parent_outputs(touched.values())
        return outputs

    def _parent_outputs(self, parents) -> list[RequestOutput]:
        """One output per parent whose children advanced this step; a finished family is forgotten."""
        outputs = []
        for parent in parents:
            out = parent.make_output()
            if out is not None:
                outputs.append(out)
            if parent.is_finished:
                self.parents.remove(parent)
                self.held_ids.discard(parent.request_id)
        return outputs

    def _make_output(self, req: Request, error: BaseException | None) -> RequestOutput:
        tracked = self._tracked[req.request_id]
        detok = tracked.detokenizer
        delta = detok.take_delta()
        is_delta = req.sampling_params.output_kind == RequestOutputKind.DELTA
        if is_delta:
            text, token_ids = delta, req.output_token_ids[tracked.num_sent:]
        else:
            text, token_ids = detok.output_text, list(req.output_token_ids)
        wants_logprobs = req.sampling_params.logprobs is not None
        # DELTA outputs carry the logprobs of their new tokens only, as vLLM's
        logprobs = req.logprobs[tracked.num_sent if is_delta else 0:] if wants_logprobs else None
        tracked.num_sent = req.num_output_tokens
        completion = CompletionOutput(
            index=0, text=text, token_ids=token_ids, finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason, delta=delta,
            cumulative_logprob=req.cumulative_logprob if wants_logprobs else None,
            logprobs=logprobs,
        )
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            outputs=[completion], finished=req.is_finished, num_cached_tokens=max(req.num_cached_tokens, 0),
            prompt_logprobs=None if tracked.prompt_logprobs is None else self._prompt_logprobs_to_send(req, tracked),
            metrics=RequestMetrics(req.arrival_time, req.first_token_time, req.finished_time), error=error,
        )

    def _prompt_logprobs_to_send(self, req: Request, tracked: _Tracked) -> list[PositionLogprobs | None] | None:
        """The prompt logprobs in every output, or only in the first one for DELTA outputs (as vLLM)."""
        if tracked.prompt_logprobs_sent and req.sampling_params.output_kind == RequestOutputKind.DELTA:
            return None
        tracked.prompt_logprobs_sent = True
        return list(tracked.prompt_logprobs)

    def _is_held(self, req: Request) -> bool:
        """Whether the consumer of the request (or of its n > 1 parent) has not taken its last output."""
        if req.request_id in self.held_ids:
            return True
        parent = self.parents.parent_of(req.request_id) if self.parents else None
        return parent is not None and parent.request_id in self.held_ids

    def has_request(self, request_id: str) -> bool:
        return request_id in self._tracked or (bool(self.parents) and self.parents.holds(request_id))


def _update_until_stop(req: Request, detokenizer: IncrementalDetokenizer, new_tokens: list[int]) -> str | None:
    """Feeds a run of new tokens one at a time, as they would have come without speculative decoding: a
    stop string completed before the run's end stops the request at that token, and the tokens after it
    are dropped (vLLM truncates there too)."""
    last = len(new_tokens) - 1
    for i, token in enumerate(new_tokens):
        stop = detokenizer.update([token], finished=req.is_finished and i == last)
        if stop is not None:
            if i < last:
                del req.output_token_ids[i - last:]
                del req.all_token_ids[i - last:]
                if req.status == RequestStatus.FINISHED_STOPPED:  # by a token the stop string came before
                    req.stop_reason = stop
            return stop
    return None


def _no_text(token_id: int) -> None:
    """decoded_token for a request with detokenize=False."""
    return None
