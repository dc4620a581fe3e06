"""The waiting queue, in first-come-first-served or priority order."""
from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from pagednb.request import Request


class FCFSQueue:
    """Arrival order; a preempted request goes back to the front (it was admitted before the rest)."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._queue.append(req)

    def add_preempted(self, req: Request) -> None:
        self._queue.appendleft(req)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, req: Request) -> None:
        self._queue.remove(req)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """Lowest `priority` value first, then earliest arrival (so a preempted request keeps its place)."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple, Request]] = []

    def add(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.sort_key(), req))

    add_preempted = add

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, req: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[1] is not req]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[1] for entry in sorted(self._heap, key=lambda e: e[0]))


def make_queue(policy: str) -> FCFSQueue | PriorityQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()
