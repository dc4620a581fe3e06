"""From requests that advanced to RequestOutputs: record logprobs, detokenize incrementally, find stop
strings."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagednb.engine.detokenizer import IncrementalDetokenizer
from pagednb.outputs import CompletionOutput, RequestMetrics, RequestOutput
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


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._tracked: dict[str, _Tracked] = {}

    def add_request(self, req: Request) -> None:
        self._tracked[req.request_id] = _Tracked(
            IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.sampling_params))

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
        """Stores the sampled token's logprob (and the top-k) on each request that asked for them."""
        if out is None or out.logprobs is None:
            return
        values = out.logprobs.tolist()
        top_vals = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        top_ids = out.top_token_ids.tolist() if out.top_token_ids is not None else None
        row_of = {s.request.request_id: i for i, s in enumerate(s for s in sched.scheduled if s.samples)}
        for req in progressed:
            i = row_of[req.request_id]  # its row among the step's sampled rows (dropped tokens leave gaps)
            k = req.sampling_params.logprobs
            if k is None or req.error is not None:  # asked for none, or its sampling failed: no token
                continue
            entry = {req.output_token_ids[-1]: values[i]}
            if top_ids is not None:
                k = int(min(k, len(top_ids[i])))  # (a float or a count past the vocabulary, as the sampler)
                entry.update(zip(top_ids[i][:k], top_vals[i][:k]))
            req.logprobs.append(entry)
            req.cumulative_logprob += values[i]

    def _detokenize(self, reqs: list[Request]) -> list[tuple[Request, str]]:
        """Feeds new tokens to each request's detokenizer; returns (request, stop string) for requests
        whose text now contains a stop string: they end as stopped, also when the same token reached
        max_tokens (the stop string wins, as in vLLM)."""
        stopped = []
        for req in reqs:
            tracked = self._tracked[req.request_id]
            if tracked.detokenizer.defers_until_finished and not req.is_finished:
                continue
            new_tokens = req.output_token_ids[tracked.num_detokenized:]
            tracked.num_detokenized = req.num_output_tokens
            stop = tracked.detokenizer.update(new_tokens, finished=req.is_finished)
            if stop is not None and req.status in (RequestStatus.RUNNING, RequestStatus.FINISHED_LENGTH_CAPPED):
                stopped.append((req, stop))
        return stopped

    def _make_outputs(self, reqs: list[Request], error: BaseException | None = None) -> list[RequestOutput]:
        outputs = []
        final_only = RequestOutputKind.FINAL_ONLY
        for req in reqs:
            if req.sampling_params.output_kind is final_only and not req.is_finished:
                continue
            outputs.append(self._make_output(req, error if error is not None else req.error))
            if req.is_finished:
                del self._tracked[req.request_id]
        return outputs

    def _make_output(self, req: Request, error: BaseException | None) -> RequestOutput:
        tracked = self._tracked[req.request_id]
        detok = tracked.detokenizer
        delta = detok.take_delta()
        if req.sampling_params.output_kind == RequestOutputKind.DELTA:
            text, token_ids = delta, req.output_token_ids[tracked.num_sent:]
        else:
            text, token_ids = detok.output_text, list(req.output_token_ids)
        tracked.num_sent = req.num_output_tokens
        wants_logprobs = req.sampling_params.logprobs is not None
        completion = CompletionOutput(
            index=0, text=text, token_ids=token_ids, finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason, delta=delta,
            cumulative_logprob=req.cumulative_logprob if wants_logprobs else None,
            logprobs=list(req.logprobs) if wants_logprobs else None,
        )
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            outputs=[completion], finished=req.is_finished, num_cached_tokens=max(req.num_cached_tokens, 0),
            metrics=RequestMetrics(req.arrival_time, req.first_token_time, req.finished_time), error=error,
        )

    def has_request(self, request_id: str) -> bool:
        return request_id in self._tracked
