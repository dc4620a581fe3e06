"""SamplingParams: the accepted range of every field (a table that reads like the spec), normalisation
of integral floats and top_k=0, the top_p floor, greedy detection, cloning."""
import numpy as np
import pytest

from pagednb.sampling_params import TOP_P_FLOOR, RequestOutputKind, SamplingParams, SamplingType

NAN, INF = float("nan"), float("inf")

# (field, refused value, error type, what the message says is accepted)
REFUSED = [
    ("temperature", -0.5, ValueError, "a finite number in [0, 3.4e+38]"),
    ("temperature", NAN, ValueError, "a finite number"),
    ("temperature", INF, ValueError, "a finite number"),
    ("temperature", 1e39, ValueError, "3.4e+38"),  # inf once in float32
    ("temperature", "0.7", TypeError, "a finite number"),
    ("temperature", True, TypeError, "a finite number"),
    ("temperature", None, TypeError, "a finite number"),
    ("top_p", 0.0, ValueError, "in (0, 1]"),
    ("top_p", -1e-300, ValueError, "in (0, 1]"),
    ("top_p", 1.5, ValueError, "in (0, 1]"),
    ("top_p", NAN, ValueError, "in (0, 1]"),
    ("top_p", "1", TypeError, "in (0, 1]"),
    ("top_k", -2, ValueError, "-1 or 0 (off) or an int >= 1"),
    ("top_k", 2.5, TypeError, "-1 or 0 (off) or an int >= 1"),
    ("top_k", True, TypeError, "an int"),
    ("top_k", NAN, TypeError, "an int"),
    ("top_k", INF, TypeError, "an int"),
    ("top_k", "40", TypeError, "an int"),
    ("min_p", -0.1, ValueError, "in [0, 1]"),
    ("min_p", 1.1, ValueError, "in [0, 1]"),
    ("min_p", NAN, ValueError, "in [0, 1]"),
    ("seed", 1.5, TypeError, "None or an int in [0, 18446744073709551615]"),
    ("seed", -1, ValueError, "None or an int in [0, 18446744073709551615]"),
    ("seed", 2**64, ValueError, "None or an int in [0, 18446744073709551615]"),
    ("seed", True, TypeError, "an int"),
    ("seed", "7", TypeError, "an int"),
    ("repetition_penalty", 0.0, ValueError, "in [1e-06, 1e+06]"),
    ("repetition_penalty", 1e-40, ValueError, "in [1e-06, 1e+06]"),  # NaN logits once applied
    ("repetition_penalty", -1.0, ValueError, "in [1e-06, 1e+06]"),
    ("repetition_penalty", 1e7, ValueError, "in [1e-06, 1e+06]"),
    ("repetition_penalty", INF, ValueError, "in [1e-06, 1e+06]"),
    ("repetition_penalty", NAN, ValueError, "in [1e-06, 1e+06]"),
    ("presence_penalty", 2.5, ValueError, "in [-2, 2]"),
    ("presence_penalty", NAN, ValueError, "in [-2, 2]"),
    ("frequency_penalty", -2.1, ValueError, "in [-2, 2]"),
    ("frequency_penalty", -INF, ValueError, "in [-2, 2]"),
    ("max_tokens", 0, ValueError, "None or an int >= 1"),
    ("max_tokens", 2.5, TypeError, "None or an int >= 1"),
    ("max_tokens", True, TypeError, "None or an int >= 1"),
    ("min_tokens", -1, ValueError, "an int >= 0"),
    ("min_tokens", 1.5, TypeError, "an int >= 0"),
    ("stop", ["ok", ""], ValueError, "non-empty strings"),
    ("stop", "", ValueError, "non-empty strings"),
    ("stop", ["ok", 3], TypeError, "non-empty strings"),
    ("stop", 5, TypeError, "None, a str or a list of str"),
    ("stop_token_ids", [3, -1], ValueError, "an int >= 0"),
    ("stop_token_ids", [1.5], TypeError, "an int >= 0"),
    ("stop_token_ids", [True], TypeError, "an int >= 0"),
    ("stop_token_ids", 7, TypeError, "None or a list of ints >= 0"),
    ("logprobs", -2, ValueError, "None or an int >= -1"),
    ("logprobs", 2.5, TypeError, "None or an int >= -1"),
    ("logprobs", True, TypeError, "None or an int >= -1"),
    ("prompt_logprobs", -2, ValueError, "None or an int >= -1"),
    ("prompt_logprobs", "3", TypeError, "None or an int >= -1"),
    ("truncate_prompt_tokens", 0, ValueError, "None or an int >= 1"),
    ("truncate_prompt_tokens", True, TypeError, "None or an int >= 1"),
    ("output_kind", "delta", TypeError, "a RequestOutputKind"),
    ("output_kind", 1, TypeError, "a RequestOutputKind"),
    ("ignore_eos", 1, TypeError, "True or False"),
    ("skip_special_tokens", "yes", TypeError, "True or False"),
    ("include_stop_str_in_output", None, TypeError, "True or False"),
]


@pytest.mark.parametrize("field, value, error, accepted", REFUSED,
                         ids=[f"{f}={v!r}" for f, v, _, _ in REFUSED])
def test_refused_value_raises_naming_the_field_and_the_accepted_range(field, value, error, accepted):
    with pytest.raises(error) as info:
        SamplingParams(**{field: value})
    assert type(info.value) is error  # a wrong type is a TypeError, a value out of range a ValueError
    message = str(info.value)
    assert message.startswith(field) and " must be " in message
    assert accepted in message


def test_the_example_message():
    with pytest.raises(ValueError, match=r"^temperature must be a finite number in \[0, 3\.4e\+38\], got -0\.5$"):
        SamplingParams(temperature=-0.5)


@pytest.mark.parametrize("field, given, stored", [
    ("top_k", 40.0, 40),  # JSON sends integral floats
    ("top_k", np.int64(7), 7),
    ("top_k", 0, -1),  # 0 and -1 both mean off, as in vLLM; stored as -1
    ("top_k", -1, -1),
    ("top_k", 0.0, -1),
    ("max_tokens", 32.0, 32),
    ("min_tokens", 2.0, 2),
    ("seed", 7.0, 7),
    ("seed", 2**64 - 1, 2**64 - 1),
    ("logprobs", 2.0, 2),
    ("logprobs", -1, -1),  # the whole vocabulary, as in vLLM
    ("prompt_logprobs", 0.0, 0),
    ("truncate_prompt_tokens", np.int32(5), 5),
    ("temperature", 1, 1.0),
    ("top_p", np.float32(0.5), 0.5),
    ("repetition_penalty", 1e-6, 1e-6),
    ("stop_token_ids", (3.0, np.int64(4)), [3, 4]),
])
def test_accepted_values_are_normalised_to_plain_python_types(field, given, stored):
    value = getattr(SamplingParams(**{field: given}), field)
    assert value == stored and type(value) is type(stored)
    if isinstance(stored, list):
        assert all(type(v) is int for v in value)


def test_top_p_underflow_is_raised_to_a_floor_that_keeps_the_same_tokens():
    """Below 1e-8, top_p keeps only the most likely token either way (its probability is at least
    1/vocab_size); the floor only stops a float32 underflow to 0 (which would keep no token at all)."""
    assert SamplingParams(top_p=1e-300).top_p == TOP_P_FLOOR == 1e-8
    assert np.float32(TOP_P_FLOOR) > 0
    assert SamplingParams(top_p=0.3).top_p == 0.3


def test_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_defaults_are_valid_and_normalised():
    p = SamplingParams()
    assert p.stop == [] and p.stop_token_ids == [] and p.top_k == -1
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert p.sampling_type is SamplingType.RANDOM and not p.is_greedy


def test_min_tokens_cannot_exceed_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\), got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)
    SamplingParams(max_tokens=None, min_tokens=5)


@pytest.mark.parametrize("temperature, greedy", [(0.0, True), (1e-6, True), (1e-5, False), (0.7, False)])
def test_tiny_temperatures_are_greedy(temperature, greedy):
    p = SamplingParams(temperature=temperature)
    assert p.is_greedy is greedy
    assert (p.sampling_type is SamplingType.GREEDY) is greedy


def test_seeded_sampling_type():
    assert SamplingParams(seed=7).sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams(seed=7, temperature=0).sampling_type is SamplingType.GREEDY


def test_has_penalties():
    assert not SamplingParams().has_penalties
    assert SamplingParams(repetition_penalty=1.2).has_penalties
    assert SamplingParams(presence_penalty=0.5).has_penalties
    assert SamplingParams(frequency_penalty=-0.5).has_penalties


def test_clone_is_equal_and_independent():
    p = SamplingParams(temperature=0.3, stop=["x"], stop_token_ids=[5], seed=3)
    q = p.clone()
    assert q == p
    q.stop.append("y")
    q.stop_token_ids.append(6)
    assert p.stop == ["x"] and p.stop_token_ids == [5]


@pytest.mark.parametrize("field, value, error", [("top_k", 2.5, TypeError), ("logprobs", True, TypeError),
                                                 ("temperature", NAN, ValueError), ("stop", [""], ValueError)])
def test_a_field_set_after_construction_is_checked_by_clone(field, value, error):
    """The engine adds a clone of each request's params, so a field changed after construction is
    checked then, not sampled with."""
    p = SamplingParams()
    setattr(p, field, value)
    with pytest.raises(error, match=f"^{field}"):
        p.clone()
