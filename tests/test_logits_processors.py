"""logit_bias, allowed_token_ids and bad_words (vLLM's semantics) with the embedded model, and their checks."""
from __future__ import annotations

import pytest
import torch

from pagednb import LLM, SamplingParams
from pagednb.engine.logits_processors import LogitsAdjustments, _banned_last_tokens, apply_logits_adjustments
from pagednb.engine.sampler import SamplingMetadata

PROMPTS = ["Once upon a time", "The cat", "A story about a frog", "Hello"]


@pytest.fixture(scope="module")
def llm():
    engine = LLM()
    yield engine
    engine.llm_engine.close()


def _tokens(llm, prompts, params) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_plus_100_bias_forces_a_token_at_greedy(llm):
    greedy = _tokens(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    forced = next(t for t in range(10, 1000) if all(t not in out for out in greedy))
    biased = _tokens(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                   logit_bias={forced: 100.0}))
    assert all(out == [forced] * 8 for out in biased)


def test_negative_bias_moves_greedy_off_its_token(llm):
    greedy = _tokens(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=1))
    for prompt, (first,) in zip(PROMPTS, greedy):
        (other,) = _tokens(llm, [prompt], SamplingParams(temperature=0, max_tokens=1, logit_bias={first: -100}))
        assert other[0] != first


def test_allowed_token_ids_bound_every_sampled_token(llm):
    allowed = [5, 17, 99, 300, 301, 777]
    params = [SamplingParams(temperature=t, seed=i, max_tokens=20, ignore_eos=True, allowed_token_ids=allowed)
              for i, t in enumerate([0.0, 1.0, 2.0, 5.0])]
    outs = _tokens(llm, PROMPTS, params)
    assert all(set(out) <= set(allowed) for out in outs)
    assert len(set().union(*outs)) > 1  # random rows reach several of them


def test_plain_rows_beside_processor_rows_are_untouched(llm):
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone = _tokens(llm, PROMPTS, plain)
    processed = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, allowed_token_ids=[3],
                               logit_bias={4: 50}, bad_words=["the"])
    mixed = _tokens(llm, PROMPTS + PROMPTS, [plain] * 4 + [processed] * 4)
    assert mixed[:4] == alone and all(out == [3] * 10 for out in mixed[4:])
    assert not llm.llm_engine.logits_processors.active  # finished requests forgotten: plain steps build nothing


def _contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_bad_words_are_never_produced_even_when_greedy_would(llm):
    tokenizer = llm.llm_engine.tokenizer
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    text = llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0].text
    words = [w for w in text.split() if w.isalpha()][:3]
    assert words
    banned = list(words)
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                            bad_words=banned), use_tqdm=False)[0].outputs[0]
    ids = list(out.token_ids)
    for word in banned:
        for form in (word, " " + word):
            seq = tokenizer.encode(form, add_special_tokens=False)
            assert not _contains(ids, seq), (word, out.text)
    # random rows too
    outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=1, max_tokens=40, bad_words=banned),
                        use_tqdm=False)
    for o in outs:
        for word in banned:
            for form in (word, " " + word):
                assert not _contains(list(o.outputs[0].token_ids), tokenizer.encode(form, add_special_tokens=False))


def test_bad_word_last_token_banned_only_after_its_prefix():
    words = [[7], [1, 2, 3]]
    assert _banned_last_tokens(words, []) == [7]
    assert _banned_last_tokens(words, [9, 1, 2]) == [7, 3]
    assert _banned_last_tokens(words, [1, 2, 9]) == [7]


def test_apply_adjustments_order_and_rows():
    logits = torch.zeros(3, 8)
    adj = LogitsAdjustments(allowed_rows=torch.tensor([1]), allowed_positions=torch.tensor([2, 5]),
                            banned_positions=torch.tensor([0 * 8 + 4, 1 * 8 + 5]),
                            bias_positions=torch.tensor([2 * 8 + 6, 1 * 8 + 2]),
                            bias_values=torch.tensor([3.0, -1.0]))
    out = apply_logits_adjustments(logits.clone(), adj)
    inf = float("-inf")
    assert out[0].tolist() == [0, 0, 0, 0, inf, 0, 0, 0]
    assert out[1].tolist() == [inf, inf, -1.0, inf, inf, inf, inf, inf]
    assert out[2].tolist() == [0, 0, 0, 0, 0, 0, 3.0, 0]


def test_plain_metadata_has_no_adjustments():
    md = SamplingMetadata.build([SamplingParams(temperature=0)], [None], [[1]], [[]], 16, torch.device("cpu"))
    assert md.adjustments is None and md.is_plain_greedy


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(logit_bias=[1, 2]), TypeError, "logit_bias"),
    (dict(logit_bias={1: float("nan")}), ValueError, r"logit_bias\[1\]"),
    (dict(logit_bias={-1: 1.0}), ValueError, "logit_bias key"),
    (dict(logit_bias={"a": 1.0}), TypeError, "logit_bias key"),
    (dict(allowed_token_ids=[]), ValueError, "allowed_token_ids"),
    (dict(allowed_token_ids=[1, -2]), ValueError, r"allowed_token_ids\[1\]"),
    (dict(allowed_token_ids=3), TypeError, "allowed_token_ids"),
    (dict(bad_words="word"), TypeError, "bad_words"),
    (dict(bad_words=["ok", 3]), TypeError, "bad_words"),
])
def test_bad_values_are_refused_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("field", ["logit_bias", "allowed_token_ids"])
def test_ids_outside_the_vocabulary_are_refused_at_add_time(llm, field):
    vocab = llm.llm_engine.spec.vocab_size
    value = {vocab: 1.0} if field == "logit_bias" else [0, vocab]
    with pytest.raises(ValueError, match=rf"{field} has token id {vocab}, outside the vocabulary \[0, {vocab}\)"):
        llm.llm_engine.add_request("out-of-vocab", "Hello", SamplingParams(**{field: value}))
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_row_with_nothing_left_to_sample_fails_alone(llm):
    """allowed_token_ids of one word that bad_words bans leaves no token: that request alone ends with
    "error", the request beside it finishes."""
    tokenizer = llm.llm_engine.tokenizer
    word, token = next((w, t) for t in range(100, 1000) for w in [tokenizer.decode([t])]
                       if w.isalpha() and tokenizer.encode(w, add_special_tokens=False) == [t])
    engine = llm.llm_engine
    engine.add_request("nothing-left", PROMPTS[0], SamplingParams(max_tokens=3, allowed_token_ids=[token],
                                                                   bad_words=[word]))
    engine.add_request("beside", PROMPTS[1], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o.outputs[0]) for o in engine.step() if o.finished)
    assert finals["nothing-left"].finish_reason == "error"
    assert finals["beside"].finish_reason == "length" and len(finals["beside"].token_ids) == 3
