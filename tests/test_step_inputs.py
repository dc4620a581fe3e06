"""Step inputs: the preallocated buffers they are written into, and which steps a decode CUDA graph
serves. (The graphs themselves run on a GPU: tests/test_gpu_engine.py.)"""
import numpy as np
import pytest
import torch

from pagednb.engine.cuda_graphs import DecodeGraphs
from pagednb.engine.scheduler import ScheduledRequest, SchedulerOutput
from pagednb.engine.step_buffers import StepBuffers


def test_the_same_step_shape_always_gets_the_same_addresses():
    """A captured graph reads its inputs where the next step of its size writes them."""
    buffers = StepBuffers(max_tokens=64, max_seqs=8, max_blocks_per_seq=4, device=torch.device("cpu"))
    first = buffers.views(8, 8, 4, 8)
    buffers.views(37, 3, 2, 1)  # an eager step in between
    again = buffers.views(8, 8, 4, 8)
    for name in ("input_ids", "positions", "slot_mapping", "logits_indices", "query_start_loc", "seq_lens",
                 "block_tables"):
        assert getattr(first, name).data_ptr() == getattr(again, name).data_ptr(), name


def test_views_do_not_overlap_and_host_writes_reach_the_tensors():
    buffers = StepBuffers(max_tokens=64, max_seqs=8, max_blocks_per_seq=4, device=torch.device("cpu"))
    v = buffers.views(5, 2, 3, 2)
    v.host_input_ids[:] = 1
    v.host_positions[:] = 2
    v.host_slots[:] = 3
    v.host_logits_indices[:] = 4
    v.host_query_start_loc[:] = 5
    v.host_seq_lens[:] = 6
    v.host_block_tables[:] = 7
    assert v.input_ids.tolist() == [1] * 5 and v.positions.tolist() == [2] * 5
    assert v.slot_mapping.tolist() == [3] * 5 and v.logits_indices.tolist() == [4] * 2
    assert v.query_start_loc.tolist() == [5] * 3 and v.seq_lens.tolist() == [6] * 2
    assert v.block_tables.shape == (2, 3) and v.block_tables.eq(7).all()


def test_a_step_larger_than_the_buffers_is_refused():
    buffers = StepBuffers(max_tokens=16, max_seqs=4, max_blocks_per_seq=4, device=torch.device("cpu"))
    try:
        buffers.views(17, 1, 1, 1)
    except ValueError as e:
        assert "17 tokens" in str(e)
    else:
        raise AssertionError("no error")


def test_bucket_sizes_are_small_powers_of_two_then_multiples_of_16_up_to_the_limit():
    assert DecodeGraphs.bucket_sizes(1) == [1]
    assert DecodeGraphs.bucket_sizes(5) == [1, 2, 4, 5]
    assert DecodeGraphs.bucket_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    sizes = DecodeGraphs.bucket_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and np.all(np.diff(sizes[4:]) == 16)


def test_an_eager_steps_lm_head_rows_are_padded_to_a_bucket_size():
    """Few GEMM shapes for cuBLAS (a new one costs host time once per process), the graphs' among them."""
    sizes = DecodeGraphs.bucket_sizes(256)
    for n in range(1, 257):
        padded = DecodeGraphs.rows_bucket(n, 256)
        assert padded in sizes and padded >= n and padded - n < max(n, 16), n
    assert DecodeGraphs.rows_bucket(0, 256) == 0  # no LM head at all
    assert DecodeGraphs.rows_bucket(3, 256) == 4 and DecodeGraphs.rows_bucket(17, 256) == 32
    assert DecodeGraphs.rows_bucket(17, 20) == 20 and DecodeGraphs.rows_bucket(20, 20) == 20  # never past the limit


def test_the_logits_rows_may_outnumber_the_steps_sequences_up_to_the_buffers_rows():
    buffers = StepBuffers(max_tokens=64, max_seqs=8, max_blocks_per_seq=4, device=torch.device("cpu"))
    v = buffers.views(37, 3, 2, 4)  # 3 sequences, 4 rows of logits (one padding row)
    assert len(v.logits_indices) == 4
    with pytest.raises(ValueError, match="9 rows of logits exceeds the buffers"):
        buffers.views(37, 3, 2, 9)  # more than the buffers' 8 rows


def _sched(*tokens_and_samples) -> SchedulerOutput:
    return SchedulerOutput(scheduled=[ScheduledRequest(None, 0, n, [], False, samples)
                                      for n, samples in tokens_and_samples])


def test_only_decode_steps_that_fit_the_largest_bucket_replay_a_graph():
    graphs = DecodeGraphs(sizes=DecodeGraphs.bucket_sizes(40))
    assert graphs.size_for(_sched((1, True))) == 1
    assert graphs.size_for(_sched(*[(1, True)] * 3)) == 4  # padded to the next bucket
    assert graphs.size_for(_sched(*[(1, True)] * 17)) == 32
    assert graphs.size_for(_sched(*[(1, True)] * 40)) == 40
    assert graphs.size_for(_sched(*[(1, True)] * 41)) is None  # more rows than any graph
    assert graphs.size_for(_sched((1, True), (7, True))) is None  # a prefill chunk
    assert graphs.size_for(_sched((1, True), (1, False))) is None  # a one-token chunk that samples nothing
