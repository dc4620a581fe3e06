"""Continuous batching: each step, choose which requests advance by how many tokens.

One loop over a token budget, no prefill/decode phases (vLLM v1's design): running requests first,
each getting its next decode token or its next prefill chunk; when the KV pool runs dry the lowest
priority running request is preempted (blocks freed, recomputed later); then waiting requests are
admitted in queue order while the budget, the pool and max_num_seqs allow. Prefill chunks and decode
tokens of one step go through the model in a single forward pass.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from pagednb.engine.kv_cache_manager import KVCacheManager
from pagednb.engine.request_queue import make_queue
from pagednb.engine.step_report import out_of_blocks_reason
from pagednb.request import Request, RequestStatus

logger = logging.getLogger("pagednb")


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: tokens all_token_ids[start:start + num_new_tokens]."""

    request: Request
    start: int
    num_new_tokens: int
    new_block_ids: list[int] | list[list[int]]  # a hybrid model's: one list per layer group, [] if none
    is_new: bool  # first step since (re)admission: the runner starts its block table afresh
    samples: bool  # this step reaches the end of the known tokens: its last logits give a new token
    # speculative decoding: the drafts fed after the last known token (num_new_tokens = 1 + their count);
    # each gets a row of logits (engine/spec_decode/)
    draft_token_ids: list[int] = ()


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    preemption_reasons: dict[str, str] = field(default_factory=dict)  # request id -> why (step debugger)
    # Requests that left the running set since the last step (finished, aborted, preempted): the
    # model runner drops their rows.
    released_request_ids: list[str] = field(default_factory=list)
    # Some unfinished request asked for prompt logprobs: the runner looks for prompt rows to score
    # (engine/logprobs.py); False on every plain step, which never looks.
    wants_prompt_logprobs: bool = False
    num_draft_tokens: int = 0  # drafts scheduled for verification (0: a step as without spec decode)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, policy: str = "fcfs") -> None:
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.waiting = make_queue(policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._released: list[str] = []
        # Requests whose block-table row the runner may have lost (an interrupted step): their next
        # scheduling sends the whole block list again.
        self._resync: set[str] = set()
        self._prompt_logprob_ids: set[str] = set()  # unfinished requests with prompt_logprobs

    # ---- request lifecycle -------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.add(req)
        if req.sampling_params.prompt_logprobs is not None:
            self._prompt_logprob_ids.add(req.request_id)

    def finish_requests(self, request_ids, status: RequestStatus) -> list[Request]:
        """Ends requests wherever they are (waiting or running) and frees their blocks at once."""
        finished = []
        for request_id in request_ids:
            req = self.requests.get(request_id)
            if req is None or req.is_finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, status)
            finished.append(req)
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    # ---- the step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.kv.begin_step()
        budget = self.max_num_batched_tokens
        running = RequestStatus.RUNNING
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is running:  # else it was preempted earlier in this loop
                budget -= self._schedule_running(req, budget, out)
        if not out.preempted:  # no room was short this step: admit waiting requests
            budget = self._admit_waiting(budget, out)
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            if s.samples:
                s.request.num_pending_tokens += 1
        out.released_request_ids, self._released = self._released, []
        out.wants_prompt_logprobs = bool(self._prompt_logprob_ids)
        return out

    def _schedule_running(self, req: Request, budget: int, out: SchedulerOutput) -> int:
        """Schedules req's next tokens, preempting others if the pool is short. Returns tokens used.

        A token still pending on the device counts as known (its input is read there); a request whose
        pending token is its last (max_tokens, max_model_len) is not scheduled: it ends when it arrives.
        """
        pending = req.num_pending_tokens
        num_tokens = len(req.all_token_ids) + pending
        if pending and (len(req.output_token_ids) + pending >= req.max_tokens or num_tokens >= self.max_model_len):
            return 0
        num_new = num_tokens - req.num_computed_tokens
        if num_new == 1 and req.spec_token_ids and not pending:  # drafts: proposed from every known token
            if used := self._schedule_with_drafts(req, budget, out):
                return used
        if num_new > budget:
            num_new = budget
        while (new_block_ids := self.kv.allocate_slots(req, num_new)) is None:
            victim = max(self.running, key=Request.sort_key) if self.policy == "priority" else self.running[-1]
            out.preemption_reasons[victim.request_id] = out_of_blocks_reason(self.kv, req, num_new)
            self._preempt(victim, out)
            if victim is req:
                return 0
        start = req.num_computed_tokens
        is_new = False
        if self._resync and req.request_id in self._resync:
            self._resync.discard(req.request_id)
            is_new, new_block_ids = True, self.kv.block_ids(req.request_id)
        out.scheduled.append(ScheduledRequest(req, start, num_new, new_block_ids, is_new, start + num_new == num_tokens))
        return num_new

    def _schedule_with_drafts(self, req: Request, budget: int, out: SchedulerOutput) -> int:
        """Schedules a decoding request's last token and its drafts (speculative decoding), as many as the
        budget, max_tokens and max_model_len leave room for (all accepted, the request gets one token more
        than it verifies). Returns the tokens used; 0 when none fit or the pool is short: then it decodes
        as usual (nobody is preempted for drafts). The drafts are used once either way."""
        drafts, req.spec_token_ids = req.spec_token_ids, []
        room = min(budget, req.max_tokens - len(req.output_token_ids),
                   self.max_model_len - len(req.all_token_ids)) - 1
        if room <= 0 or (new_block_ids := self.kv.allocate_slots(req, 1 + min(room, len(drafts)))) is None:
            return 0
        drafts = drafts[:room]
        is_new = False
        if self._resync and req.request_id in self._resync:  # as in _schedule_running
            self._resync.discard(req.request_id)
            is_new, new_block_ids = True, self.kv.block_ids(req.request_id)
        out.num_draft_tokens += len(drafts)
        out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens, 1 + len(drafts), new_block_ids,
                                              is_new, True, drafts))
        return 1 + len(drafts)

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> int:
        while len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.peek()
            hit = self.kv.find_prefix_hit(req)
            num_new = min(req.num_tokens - hit.num_tokens, budget)
            new_block_ids = self.kv.allocate_slots(req, num_new, hit)
            if new_block_ids is None:
                break  # head-of-line waits: admitting smaller requests past it would starve it
            self.waiting.pop()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = hit.num_tokens
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = hit.num_tokens
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, hit.num_tokens, num_new, new_block_ids, True,
                                                  hit.num_tokens + num_new == req.num_tokens))
            budget -= num_new
        return budget

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        """Frees the victim's blocks and sends it back to the waiting queue to be recomputed."""
        for i, s in enumerate(out.scheduled):
            if s.request is victim:  # already given tokens this step (priority policy): take them back
                del out.scheduled[i]
                break
        self.running.remove(victim)
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_preempted(victim)
        self._released.append(victim.request_id)
        out.preempted.append(victim)

    def rollback(self, out: SchedulerOutput) -> None:
        """Undoes a step whose model run never finished: its tokens count as not computed."""
        for s in out.scheduled:
            s.request.num_computed_tokens = s.start
            if s.samples:
                s.request.num_pending_tokens -= 1
            self._resync.add(s.request.request_id)

    # ---- after the model ran ---------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled_token_ids: list[int],
                           num_accepted: list[int] | None = None) -> list[Request]:
        """Appends each sampling request's new token and applies token-level stops.

        sampled_token_ids holds one token per scheduled request that samples, in schedule order; a
        negative one (the sampler's INVALID_TOKEN_ID) ends that request alone with a SamplingError.
        num_accepted (a step with drafts, engine/spec_decode/verifier.py), in the same order: how many of
        its drafts each request accepted; it gets those, then its token, up to the first stop among them;
        its rejected drafts' K/V no longer count as computed (later tokens overwrite them).
        Returns the requests that got a token or failed so (finished ones included). With asynchronous
        scheduling the next step is already scheduled: a request may have been preempted since (its token
        still counts) or finished (aborted, or stopped by the token before: this token is dropped).
        """
        now = time.monotonic()
        progressed = []
        tokens = iter(sampled_token_ids)
        commit = self.kv.commit_computed
        finished = RequestStatus.PREEMPTED
        accepted_counts = iter(num_accepted) if num_accepted is not None else None
        for s in out.scheduled:
            req = s.request
            token = next(tokens) if s.samples else None
            accepted = next(accepted_counts) if accepted_counts is not None and s.samples else 0
            if req.status > finished:
                continue
            if token is not None and token < 0:
                self._fail_sampling(req)
                progressed.append(req)
                continue
            computed = s.start + s.num_new_tokens
            if accepted_counts is not None and s.draft_token_ids:
                computed -= len(s.draft_token_ids) - accepted  # the rejected drafts'
                req.num_computed_tokens = computed
            commit(req, computed)
            if token is None:
                continue
            req.num_pending_tokens -= 1
            status = self._append_accepted_drafts(req, s.draft_token_ids[:accepted]) if accepted else None
            if status is None:
                req.output_token_ids.append(token)
                req.all_token_ids.append(token)
                if req.first_token_time is None:
                    req.first_token_time = now
                status = self._check_stop(req)
            if status is not None:
                if req.status == RequestStatus.RUNNING:
                    self.running.remove(req)
                else:
                    self.waiting.remove(req)
                self._finish(req, status)
            progressed.append(req)
        return progressed

    def _append_accepted_drafts(self, req: Request, drafts: list[int]) -> RequestStatus | None:
        """Appends accepted drafts one by one; the status of the first token-level stop among them (EOS,
        a stop token, max_tokens), whose later tokens are dropped as if never sampled."""
        for token in drafts:
            req.output_token_ids.append(token)
            req.all_token_ids.append(token)
            status = self._check_stop(req)
            if status is not None:
                return status
        return None

    def _fail_sampling(self, req: Request) -> None:
        """Ends a request whose row the sampler flagged (no valid distribution): FINISHED_ERROR with
        req.error set, its blocks freed and the ones it computed dropped from the prefix cache (their K/V
        may be NaN too). Nothing of this step is committed for it."""
        req.num_pending_tokens -= 1
        req.error = req.sampling_error()
        logger.warning("%s", req.error)
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._finish(req, RequestStatus.FINISHED_ERROR, forget_blocks=True)

    def _check_stop(self, req: Request) -> RequestStatus | None:
        token = req.output_token_ids[-1]
        params = req.sampling_params
        num_output = len(req.output_token_ids)
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if num_output >= req.max_tokens or len(req.all_token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _finish(self, req: Request, status: RequestStatus, forget_blocks: bool = False) -> None:
        req.status = status
        req.finished_time = time.monotonic()
        if forget_blocks:
            self.kv.free_and_forget(req)
        else:
            self.kv.free(req)
        self._released.append(req.request_id)
        self._prompt_logprob_ids.discard(req.request_id)
        del self.requests[req.request_id]
