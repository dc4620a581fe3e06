"""Parallel sampling (`SamplingParams(n=...)`): one prompt, n completions, as vLLM v1 does it.

A parent request fans out into n child Requests, `"{i}_{parent_id}"` for i in 0..n-1, queued together
and scheduled like any other request. Their prompt K/V is computed once: children admitted in the same
step share the full blocks the first one computes (the scheduler's same-step prefix sharing), later
ones hit them in the prefix cache; only the prompt's last, partial block is computed per child (its
last token's logits give each child its first token). Child i samples with its own generator, seeded
`seed + i` when a seed is given (vLLM's rule), so a completion never depends on its batch.

Fan-in happens here too: each step the children's CompletionOutputs (index i) become one RequestOutput
under the parent's id. FINAL_ONLY: one output with all n completions once every child finished.
CUMULATIVE: every output holds all n completions in index order, each as it stands (one not yet
started is empty). DELTA: an output holds only the completions that changed in that step, in index
order. The parent is finished when all n are; aborting the parent id aborts all n; a child that fails
ends the parent with its error, its siblings aborted.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pagednb.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagednb.request import Request, RequestStatus
from pagednb.sampling_params import RequestOutputKind, SamplingParams


def child_request_id(parent_id: str, index: int) -> str:
    """vLLM's naming: the index, an underscore, the parent's id."""
    return f"{index}_{parent_id}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """One completion's parameters: n=1, and seed + index when seeded (vLLM's rule)."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params.clone(), n=1, seed=seed)


@dataclass(eq=False)
class ParentRequest:
    """The n children of one request and what their last outputs were, for the fan-in."""

    request_id: str
    children: list[Request]
    output_kind: RequestOutputKind
    _latest: list[CompletionOutput | None] = field(init=False)
    _changed: dict[int, CompletionOutput] = field(default_factory=dict, init=False)
    error: BaseException | None = field(default=None, init=False)
    _prompt_logprobs: list | None = field(default=None, init=False)
    _prompt_logprobs_sent: bool = field(default=False, init=False)  # (DELTA outputs)

    def __post_init__(self) -> None:
        self._latest = [None] * len(self.children)
        self.index_of = {child.request_id: i for i, child in enumerate(self.children)}

    @property
    def child_ids(self) -> list[str]:
        return [child.request_id for child in self.children]

    @property
    def is_finished(self) -> bool:
        return all(child.is_finished for child in self.children)

    def unfinished_sibling_ids(self) -> list[str]:
        return [child.request_id for child in self.children if not child.is_finished]

    def record(self, child_output: RequestOutput) -> None:
        """Keeps a child's output of this step (its completion, index set) for the parent's next output."""
        completion = child_output.outputs[0]
        completion.index = self.index_of[child_output.request_id]
        self._latest[completion.index] = completion
        self._changed[completion.index] = completion
        if child_output.error is not None and self.error is None:
            self.error = child_output.error
        if child_output.prompt_logprobs is not None and not self._prompt_logprobs_sent:  # same for all children
            self._prompt_logprobs = child_output.prompt_logprobs

    def make_output(self) -> RequestOutput | None:
        """This step's output for the parent, or None (FINAL_ONLY before the end; nothing changed)."""
        finished = self.is_finished
        if not self._changed or (self.output_kind is RequestOutputKind.FINAL_ONLY and not finished):
            return None
        if self.output_kind is RequestOutputKind.DELTA:
            completions = [self._changed[i] for i in sorted(self._changed)]
        else:
            completions = [c if c is not None else CompletionOutput(index=i, text="", token_ids=[])
                           for i, c in enumerate(self._latest)]
        self._changed = {}
        first = self.children[0]
        out = RequestOutput(
            request_id=self.request_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
            outputs=completions, finished=finished,
            num_cached_tokens=max(max(child.num_cached_tokens, 0) for child in self.children),
            metrics=self._metrics(), error=self.error)
        out.prompt_logprobs = self._prompt_logprobs
        if self.output_kind is RequestOutputKind.DELTA:  # sent once, in the first output (as vLLM)
            self._prompt_logprobs_sent |= self._prompt_logprobs is not None
            if self._prompt_logprobs_sent:
                self._prompt_logprobs = None
        return out

    def _metrics(self) -> RequestMetrics:
        firsts = [c.first_token_time for c in self.children if c.first_token_time is not None]
        ends = [c.finished_time for c in self.children if c.finished_time is not None]
        return RequestMetrics(self.children[0].arrival_time, min(firsts) if firsts else None,
                              max(ends) if len(ends) == len(self.children) else None)


class ParentRegistry:
    """The parents in flight, found by their own id or by a child's id (the output processor's)."""

    def __init__(self) -> None:
        self._by_id: dict[str, ParentRequest] = {}
        self._by_child: dict[str, ParentRequest] = {}

    def __bool__(self) -> bool:
        return bool(self._by_id)

    def add(self, parent: ParentRequest) -> None:
        self._by_id[parent.request_id] = parent
        for child_id in parent.child_ids:
            self._by_child[child_id] = parent

    def remove(self, parent: ParentRequest) -> None:
        del self._by_id[parent.request_id]
        for child_id in parent.child_ids:
            del self._by_child[child_id]

    def parent_of(self, child_id: str) -> ParentRequest | None:
        return self._by_child.get(child_id)

    def holds(self, request_id: str) -> bool:
        """A parent's id, or a child's: both stay in use until the whole family has finished."""
        return request_id in self._by_id or request_id in self._by_child

    def expand(self, request_ids) -> list[str]:
        """Each parent id replaced by its children's ids (what the scheduler knows); others as given."""
        out: list[str] = []
        for request_id in request_ids:
            parent = self._by_id.get(request_id)
            out.extend(parent.child_ids if parent is not None else [request_id])
        return out

    def siblings_to_abort(self, reqs: list[Request]) -> list[str]:
        """The still-running siblings of children that just failed: a child's error ends the parent."""
        ids: list[str] = []
        for req in reqs:
            if req.status is RequestStatus.FINISHED_ERROR:
                parent = self._by_child.get(req.request_id)
                if parent is not None:
                    ids.extend(parent.unfinished_sibling_ids())
        return ids
