"""The scheduler and KV cache manager without a model: token budget, chunked prefill, admission
order, preemption of the most recently admitted (or lowest priority) request, prefix hits, sliding
windows, and property tests over random add / step / abort sequences on a tiny pool."""
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from pagednb.engine.block_pool import BlockPool
from pagednb.engine.kv_cache_manager import KVCacheManager
from pagednb.engine.sampler import INVALID_TOKEN_ID as INVALID
from pagednb.engine.scheduler import Scheduler
from pagednb.request import Request, RequestStatus
from pagednb.sampling_params import SamplingParams

B = 4  # block size
_ids = itertools.count()


def make_scheduler(num_blocks=64, budget=32, max_seqs=8, policy="fcfs", caching=True, window=None, max_len=128):
    kv = KVCacheManager(BlockPool(num_blocks, caching), B, window)
    return Scheduler(kv, max_seqs, budget, max_len, policy)


def make_request(prompt_len=6, max_tokens=4, priority=0, prompt=None):
    n = next(_ids)
    tokens = prompt if prompt is not None else [(n * 7 + i) % 50 + 3 for i in range(prompt_len)]
    return Request(f"r{n}", tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_tokens,
                   priority=priority, arrival_index=n)


def run_step(sched, token=5):
    out = sched.schedule()
    sched.update_from_output(out, [token] * sum(s.samples for s in out.scheduled))
    sched.kv.pool.check_integrity(sched.kv.reference_counts())
    return out


def test_one_step_mixes_prefill_chunks_and_decode_tokens_under_the_budget():
    sched = make_scheduler(budget=10)
    first = make_request(prompt_len=5)
    sched.add_request(first)
    run_step(sched)  # first's whole prompt
    second = make_request(prompt_len=20)
    sched.add_request(second)
    out = run_step(sched)
    shares = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
    assert shares == {first.request_id: 1, second.request_id: 9}  # decode first, then a prefill chunk
    assert out.num_scheduled_tokens <= 10
    assert [s.samples for s in out.scheduled] == [True, False]  # a partial chunk samples nothing


def test_long_prompt_is_prefilled_in_chunks_and_then_decodes():
    sched = make_scheduler(budget=8)
    req = make_request(prompt_len=19, max_tokens=3)
    sched.add_request(req)
    chunks = [run_step(sched).scheduled[0].num_new_tokens for _ in range(3)]
    assert chunks == [8, 8, 3]
    assert req.num_output_tokens == 1
    while sched.has_unfinished_requests():
        run_step(sched)
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED and req.num_output_tokens == 3


def test_max_num_seqs_caps_the_running_set():
    sched = make_scheduler(max_seqs=2)
    for _ in range(3):
        sched.add_request(make_request())
    run_step(sched)
    assert len(sched.running) == 2 and len(sched.waiting) == 1


def test_fcfs_admits_in_arrival_order_and_priority_by_priority_value():
    fcfs, prio = make_scheduler(max_seqs=1), make_scheduler(max_seqs=1, policy="priority")
    for sched in (fcfs, prio):
        for priority in (5, 0, 3):
            sched.add_request(make_request(priority=priority))
    assert run_step(fcfs).scheduled[0].request.priority == 5
    assert run_step(prio).scheduled[0].request.priority == 0


def test_when_blocks_run_out_the_most_recently_admitted_is_preempted_and_recomputed():
    sched = make_scheduler(num_blocks=4, budget=64)  # 16 token slots
    old, new = make_request(prompt_len=8, max_tokens=6), make_request(prompt_len=8, max_tokens=6)
    sched.add_request(old)
    sched.add_request(new)
    run_step(sched)  # both prompts: 2 blocks each, pool full
    out = run_step(sched)  # both need a 3rd block at token 8: the newer one yields
    assert out.preempted == [new]
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert sched.waiting.peek() is new and sched.num_preemptions == 1
    while sched.has_unfinished_requests():
        run_step(sched)
    assert old.num_output_tokens == new.num_output_tokens == 6  # recomputed, then finished


def test_priority_policy_preempts_the_lowest_priority_even_if_already_scheduled():
    sched = make_scheduler(num_blocks=4, budget=64, policy="priority")
    low, high = make_request(prompt_len=8, priority=9), make_request(prompt_len=8, priority=0)
    sched.add_request(low)
    sched.add_request(high)
    run_step(sched)
    assert [r.priority for r in sched.running] == [0, 9]
    out = run_step(sched)
    assert out.preempted == [low] and [s.request for s in out.scheduled] == [high]


def test_prefix_hit_skips_cached_blocks_but_always_computes_the_last_token():
    sched = make_scheduler()
    shared = list(range(10, 22))  # 3 full blocks
    a = make_request(prompt=shared + [1, 2])
    sched.add_request(a)
    run_step(sched)
    b = make_request(prompt=shared + [7])
    sched.add_request(b)
    out = run_step(sched)
    mine = next(s for s in out.scheduled if s.request is b)
    assert (mine.start, mine.num_new_tokens, b.num_cached_tokens) == (12, 1, 12)
    c = make_request(prompt=list(shared))  # exactly 3 blocks: the last one is recomputed
    sched.add_request(c)
    out = run_step(sched)
    assert next(s for s in out.scheduled if s.request is c).start == 8
    assert sched.kv.prefix_cache_hit_tokens == 12 + 8


def test_abort_frees_blocks_at_once_wherever_the_request_is():
    sched = make_scheduler(max_seqs=1)
    running, waiting = make_request(), make_request()
    sched.add_request(running)
    sched.add_request(waiting)
    run_step(sched)
    finished = sched.finish_requests([running.request_id, waiting.request_id, "unknown"], RequestStatus.FINISHED_ABORTED)
    assert finished == [running, waiting]
    assert running.status.finish_reason == "abort"
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks
    assert not sched.has_unfinished_requests()


def test_sliding_window_keeps_at_most_window_over_block_size_plus_one_blocks():
    window = 8
    sched = make_scheduler(caching=False, window=window, budget=4)
    req = make_request(prompt_len=6, max_tokens=60)
    sched.add_request(req)
    most = 0
    while sched.has_unfinished_requests():
        run_step(sched)
        most = max(most, sched.kv.num_blocks_held(req.request_id))
    assert req.num_output_tokens == 60
    assert most <= -(-window // B) + 1


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "step", "step", "abort"]), st.integers(1, 20),
                              st.integers(1, 12), st.integers(0, 3)), min_size=1, max_size=60),
       policy=st.sampled_from(["fcfs", "priority"]), caching=st.booleans())
def test_random_add_step_abort_sequences_keep_the_pool_consistent(ops, policy, caching):
    """Every block is free xor referenced, ref counts equal holders, nothing leaks, nothing is lost."""
    sched = make_scheduler(num_blocks=12, budget=16, max_seqs=4, policy=policy, caching=caching, max_len=40)
    added = []
    for op, prompt_len, max_tokens, priority in ops:
        if op == "add":
            prompt = [(prompt_len * 3 + i) % 7 for i in range(prompt_len)]  # many shared prefixes
            req = make_request(max_tokens=max_tokens, priority=priority, prompt=prompt)
            sched.add_request(req)
            added.append(req)
        elif op == "abort" and added:
            sched.finish_requests([added[prompt_len % len(added)].request_id], RequestStatus.FINISHED_ABORTED)
        else:
            run_step(sched)
    for _ in range(500):
        if not sched.has_unfinished_requests():
            break
        run_step(sched)
    assert not sched.has_unfinished_requests()
    assert all(r.is_finished for r in added)  # each ended: finished or aborted, none lost
    assert all(r.num_output_tokens == r.max_tokens for r in added if r.status != RequestStatus.FINISHED_ABORTED)
    pool = sched.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    pool.check_integrity({})


def test_blocks_offered_within_a_step_are_withdrawn_when_their_owner_frees_them():
    """A later admission in the same step may share blocks an earlier request is computing, but not
    once that request was freed (preempted) and its blocks went to someone else."""
    kv = KVCacheManager(BlockPool(4, True), B)
    shared = list(range(3, 3 + 3 * B))
    kv.begin_step()
    a = make_request(prompt=shared)
    assert kv.allocate_slots(a, 3 * B, kv.find_prefix_hit(a)) is not None  # 3 full blocks offered
    kv.free(a)
    b = make_request(prompt=[40] * (4 * B))
    assert len(kv.allocate_slots(b, 4 * B, kv.find_prefix_hit(b))) == 4  # every block, a's included
    c = make_request(prompt=shared + [9])
    assert kv.find_prefix_hit(c).num_tokens == 0


def test_a_flagged_token_ends_its_request_alone_and_forgets_only_the_blocks_it_computed():
    sched = make_scheduler(budget=64)
    shared = make_request(prompt_len=9)  # 2 full blocks of 4
    sched.add_request(shared)
    for _ in range(2):
        run_step(sched)
    bad = make_request(prompt=shared.prompt_token_ids[:8] + [40, 41, 42, 43, 44])  # hits 2 blocks, computes 1
    good = make_request(prompt_len=6)
    for req in (bad, good):
        sched.add_request(req)
    out = sched.schedule()
    assert [s.start for s in out.scheduled if s.request is bad] == [8]
    tokens = [INVALID if s.request is bad else 5 for s in out.scheduled if s.samples]
    progressed = sched.update_from_output(out, tokens)
    sched.kv.pool.check_integrity(sched.kv.reference_counts())
    assert bad in progressed and bad.status == RequestStatus.FINISHED_ERROR and bad.output_token_ids == []
    assert "output token 1" in str(bad.error) and bad.num_pending_tokens == 0
    assert good.status == RequestStatus.RUNNING and good.output_token_ids == [5]
    again = make_request(prompt=bad.prompt_token_ids)
    assert sched.kv.find_prefix_hit(again).num_tokens == 8  # the shared blocks, not the one it computed
