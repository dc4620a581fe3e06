"""Sampler: what each sampling option does to the chosen tokens and reported logprobs."""
import pytest
import torch

from pagednb.engine.sampler import INVALID_TOKEN_ID, Sampler, SamplingMetadata, apply_penalties
from pagednb.sampling_params import SamplingParams

CPU = torch.device("cpu")
V = 32
EOS = 1


def build(params, outputs=None, prompts=None, generators=None, generator=None, vocab=V):
    n = len(params)
    return SamplingMetadata.build(
        params, generators or [None] * n, prompts or [[] for _ in range(n)],
        outputs or [[] for _ in range(n)], vocab, CPU, eos_token_ids=[EOS], generator=generator)


def sample(logits, params, **kw):
    return Sampler()(logits, build(params, **kw))


def frequencies(token_ids, vocab):
    return torch.bincount(token_ids, minlength=vocab).float() / len(token_ids)


@pytest.fixture
def logits():
    return torch.randn(6, V, generator=torch.Generator().manual_seed(0)) * 3


def test_greedy_is_exactly_argmax_through_the_fast_path(logits):
    md = build([SamplingParams(temperature=0)] * 6)
    assert md.is_plain_greedy
    out = Sampler()(logits, md)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.top_logprobs is None and out.top_token_ids is None


def test_logits_are_never_modified(logits):
    before = logits.clone()
    params = [SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, min_tokens=3, top_k=3,
                             top_p=0.8, min_p=0.1, logprobs=2)] * 6
    sample(logits, params, outputs=[[1, 2, 3]] * 6, prompts=[[4, 5]] * 6,
           generator=torch.Generator().manual_seed(0))
    assert torch.equal(logits, before)


def test_top_k_1_and_tiny_top_p_equal_greedy(logits):
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        assert torch.equal(sample(logits, [SamplingParams(top_k=1)] * 6, generator=gen).token_ids,
                           logits.argmax(-1))
        assert torch.equal(sample(logits, [SamplingParams(top_p=1e-6)] * 6,
                                  generator=gen).token_ids, logits.argmax(-1))


def test_mixed_batch_keeps_greedy_rows_greedy(logits):
    params = [SamplingParams(temperature=0 if i % 2 else 5.0) for i in range(6)]
    out = sample(logits, params, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out.token_ids[1::2], logits.argmax(-1)[1::2])


def test_draws_follow_softmax_of_logits_over_temperature():
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 20000
    gen = torch.Generator().manual_seed(0)
    for temperature in (0.5, 1.0, 2.0):
        out = sample(row.expand(n, -1), [SamplingParams(temperature=temperature)] * n,
                     generator=gen, vocab=6)
        expected = (row / temperature).softmax(-1)
        assert (frequencies(out.token_ids, 6) - expected).abs().max() < 0.015
    hot = sample(row.expand(n, -1), [SamplingParams(temperature=2.0)] * n, generator=gen, vocab=6)
    cold = sample(row.expand(n, -1), [SamplingParams(temperature=0.5)] * n, generator=gen, vocab=6)
    assert frequencies(hot.token_ids, 6)[0] < 0.6 < frequencies(cold.token_ids, 6)[0]


def test_top_k_top_p_min_p_keep_only_their_tokens():
    row = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0])  # probs ~ .46 .28 .17 .06 .02 .01
    probs = row.softmax(-1)
    n = 4000
    gen = torch.Generator().manual_seed(0)
    cases = [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.7), {0, 1}),  # .46 < .7 <= .46 + .28
        (SamplingParams(min_p=0.3), {0, 1, 2}),  # p >= .3 * .46
        (SamplingParams(top_k=3, top_p=0.5), {0}),  # top-p sees the top-k renormalised: .51
        (SamplingParams(top_k=3, top_p=0.55), {0, 1}),
    ]
    for params, allowed in cases:
        out = sample(row.expand(n, -1), [params] * n, generator=gen, vocab=6)
        assert set(out.token_ids.tolist()) == allowed, params
    # Within what is kept, draws follow the renormalised distribution.
    out = sample(row.expand(n * 5, -1), [SamplingParams(top_k=3)] * (n * 5), generator=gen, vocab=6)
    kept = probs[:3] / probs[:3].sum()
    assert (frequencies(out.token_ids, 6)[:3] - kept).abs().max() < 0.02


def test_rows_with_different_filters_in_one_batch():
    row = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0])
    params = [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams()] * 300
    out = sample(row.expand(900, -1), params, generator=torch.Generator().manual_seed(0), vocab=6)
    assert set(out.token_ids[0::3].tolist()) == {0} == set(out.token_ids[1::3].tolist())
    assert len(set(out.token_ids[2::3].tolist())) >= 4


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -2.0, 4.0, -1.0, 3.0]])
    md = build([SamplingParams(repetition_penalty=2.0)], prompts=[[0]], outputs=[[1, 1]], vocab=5)
    expected = torch.tensor([[1.0, -4.0, 4.0, -1.0, 3.0]])  # 0 from prompt, 1 from output
    assert torch.equal(apply_penalties(logits, md.penalties), expected)


def test_presence_and_frequency_penalties_use_output_counts_only():
    logits = torch.zeros(1, 5)
    md = build([SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)],
               prompts=[[4, 4, 4]], outputs=[[1, 2, 2, 2]], vocab=5)
    expected = torch.tensor([[0.0, -0.75, -1.25, 0.0, 0.0]])
    assert torch.allclose(apply_penalties(logits, md.penalties), expected)


def test_penalties_apply_per_row_and_steer_greedy():
    logits = torch.tensor([[5.0, 4.0, 0.0], [5.0, 4.0, 0.0], [5.0, 4.0, 0.0]])
    params = [SamplingParams(temperature=0, frequency_penalty=2.0), SamplingParams(temperature=0),
              SamplingParams(temperature=0, repetition_penalty=1.5)]
    out = sample(logits, params, outputs=[[0], [0], [0]], vocab=3)
    assert out.token_ids.tolist() == [1, 0, 1]


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.tensor([[0.0, 9.0, 8.0, 7.0]]).expand(4, -1)
    greedy = dict(temperature=0, min_tokens=2, stop_token_ids=[2])
    params = [SamplingParams(**greedy), SamplingParams(**greedy),
              SamplingParams(**greedy, ignore_eos=True), SamplingParams(temperature=0)]
    out = sample(logits, params, outputs=[[0], [0, 0], [0], []], vocab=4)
    assert out.token_ids.tolist() == [3, EOS, EOS, EOS]


def test_seeded_rows_do_not_depend_on_their_batch(logits):
    seeded = SamplingParams(temperature=1.5, top_p=0.95, seed=42)

    def run(others, position, steps=30):
        """The seeded request's tokens over `steps` steps, always given the logits row 0."""
        gen = torch.Generator().manual_seed(seeded.seed)  # what the engine makes from the seed
        params = [*others[:position], seeded, *others[position:]]
        gens = [gen if p is seeded else None for p in params]
        rows = torch.cat([logits[1:len(others) + 1][:position], logits[:1],
                          logits[1:len(others) + 1][position:]])
        shared = torch.Generator().manual_seed(123)
        return [sample(rows, params, generators=gens, generator=shared).token_ids[position].item()
                for _ in range(steps)]

    alone = run([], 0)
    others = [SamplingParams(temperature=0.7), SamplingParams(top_k=3), SamplingParams(temperature=0),
              SamplingParams(min_p=0.2, presence_penalty=1.0)]
    assert run(others, 2) == alone
    assert run(others, 4) == alone
    assert run(others[:2], 0) == alone
    assert len(set(alone)) > 1


def test_unseeded_rows_are_reproducible_with_the_shared_generator(logits):
    params = [SamplingParams(temperature=2.0)] * 6
    first = sample(logits, params, generator=torch.Generator().manual_seed(3)).token_ids
    second = sample(logits, params, generator=torch.Generator().manual_seed(3)).token_ids
    assert torch.equal(first, second)


def test_seed_without_generator_is_an_error():
    with pytest.raises(ValueError, match="seed"):
        build([SamplingParams(seed=1)])


def test_logprobs_are_of_raw_logits_at_the_sampled_token(logits):
    params = [SamplingParams(temperature=0.8, logprobs=3, repetition_penalty=1.3),
              SamplingParams(temperature=0, logprobs=1), SamplingParams(temperature=0)] * 2
    out = sample(logits, params, outputs=[[0, 1, 2]] * 6, generator=torch.Generator().manual_seed(0))
    raw = logits.log_softmax(-1)
    assert torch.allclose(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_logprobs.shape == out.top_token_ids.shape == (6, 3)
    assert torch.all(out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:])
    assert torch.allclose(out.top_logprobs, raw.gather(1, out.top_token_ids))
    assert torch.equal(out.top_token_ids[:, 0], logits.argmax(-1))


def test_logprobs_zero_reports_only_the_sampled_token(logits):
    out = sample(logits, [SamplingParams(temperature=0, logprobs=0)] * 6)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs.shape == (6,) and out.top_logprobs is None and out.top_token_ids is None


def test_sampled_token_rank_counts_the_more_likely_tokens(logits):
    """Rank 1 for the argmax; a temperature draw's rank is 1 + the tokens above it in the raw logits."""
    params = [SamplingParams(temperature=5.0, logprobs=0), SamplingParams(temperature=0, logprobs=2)] * 3
    out = sample(logits, params, generator=torch.Generator().manual_seed(3))
    raw = logits.log_softmax(-1)
    chosen = raw.gather(1, out.token_ids[:, None])
    assert torch.equal(out.ranks, (raw > chosen).sum(-1) + 1)  # (no ties in random logits)
    assert torch.all(out.ranks[1::2] == 1)
    assert torch.any(out.ranks[0::2] > 1)  # a hot temperature does draw less likely tokens


def test_logprobs_minus_one_is_the_whole_vocabulary(logits):
    out = sample(logits, [SamplingParams(temperature=0, logprobs=-1), SamplingParams(temperature=0, logprobs=2)] * 3)
    assert out.top_token_ids.shape == (6, V)
    assert torch.equal(out.top_token_ids.sort(-1).values, torch.arange(V).expand(6, V))
    assert torch.allclose(out.top_logprobs.exp().sum(-1), torch.ones(6))


# ---- isolation: a row's bad numbers flag that row and nothing else ---------------------------------------
def bad_logits(logits):
    """Rows 0-2 with no valid distribution (a NaN, a +inf, all -inf); rows 3-5 as they were."""
    bad = logits.clone()
    bad[0, 3] = float("nan")
    bad[1, 5] = float("inf")
    bad[2, :] = float("-inf")
    return bad


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0, logprobs=3),
    SamplingParams(temperature=0.8, seed=None),
    SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=0.8, repetition_penalty=1.3, logprobs=2),
], ids=["greedy", "greedy-logprobs", "temperature", "filters", "penalties-logprobs"])
def test_rows_without_a_valid_distribution_are_flagged_and_the_others_unchanged(logits, params):
    bad = bad_logits(logits)
    gen = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    got = sample(bad, [params] * 6, generator=gen(), outputs=[[2, 3]] * 6, prompts=[[4]] * 6)
    alone = sample(logits[3:], [params] * 3, generator=gen(), outputs=[[2, 3]] * 3, prompts=[[4]] * 3)
    assert got.token_ids[:3].tolist() == [INVALID_TOKEN_ID] * 3
    if params.is_greedy:  # (random rows draw from the shared generator in row order: compare greedy only)
        assert torch.equal(got.token_ids[3:], alone.token_ids)
    assert ((got.token_ids[3:] >= 0) & (got.token_ids[3:] < V)).all()
    if params.logprobs is not None:  # the top-k do not depend on the draw
        assert torch.equal(got.top_logprobs[3:], alone.top_logprobs)
        if params.is_greedy:
            assert torch.equal(got.logprobs[3:], alone.logprobs)


def test_a_bad_row_in_a_mixed_batch_leaves_seeded_rows_as_drawn_alone(logits):
    params = [SamplingParams(temperature=0.7, seed=s) for s in range(6)]
    gens = lambda: [torch.Generator().manual_seed(s) for s in range(6)]  # noqa: E731
    got = sample(bad_logits(logits), params, generators=gens())
    clean = sample(logits, params, generators=gens())
    assert got.token_ids[:3].tolist() == [INVALID_TOKEN_ID] * 3
    assert torch.equal(got.token_ids[3:], clean.token_ids[3:])


def test_a_repetition_penalty_that_overflows_flags_its_row_only(logits):
    params = [SamplingParams(temperature=1.0, repetition_penalty=1.5) for _ in range(2)]
    params[0].repetition_penalty = 1e-40  # (past the door's check on purpose: the sampler must hold anyway)
    got = sample(logits[:2].abs() + 1, params, prompts=[[0, 1], [0, 1]], generator=torch.Generator().manual_seed(0))
    assert got.token_ids[0].item() == INVALID_TOKEN_ID and 0 <= got.token_ids[1].item() < V


def test_top_p_that_underflows_keeps_the_top_token(logits):
    p = SamplingParams(temperature=1.0, top_p=0.5)
    p.top_p = 1e-300  # 0 in float32 (past the door's check on purpose)
    got = sample(logits, [p] * 6, generator=torch.Generator().manual_seed(0))
    assert torch.equal(got.token_ids, logits.argmax(-1))


def test_counts_past_the_vocabulary_and_stop_ids_outside_it_are_harmless(logits):
    p = SamplingParams(temperature=1.0, top_k=10**9, logprobs=V, min_tokens=3, stop_token_ids=[10**6, 7])
    p.logprobs = 10**9  # (past the door's check on purpose)
    got = sample(logits, [p] * 6, generator=torch.Generator().manual_seed(0), outputs=[[]] * 6)
    assert got.top_token_ids.shape == (6, V)
    assert not (got.token_ids == 7).any() and not (got.token_ids == EOS).any()
