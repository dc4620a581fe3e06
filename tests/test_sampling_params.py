"""SamplingParams: normalisation, validation messages, greedy detection, cloning."""
import pytest

from pagednb.sampling_params import RequestOutputKind, SamplingParams, SamplingType


def test_defaults_are_valid_and_normalised():
    p = SamplingParams()
    assert p.stop == [] and p.stop_token_ids == []
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert p.sampling_type is SamplingType.RANDOM and not p.is_greedy


def test_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


@pytest.mark.parametrize("field, value, limit", [
    ("temperature", -0.5, ">= 0"),
    ("temperature", float("nan"), ">= 0"),
    ("top_p", 0.0, "in (0, 1]"),
    ("top_p", 1.5, "in (0, 1]"),
    ("top_k", 0, "-1 (off) or >= 1"),
    ("top_k", -2, "-1 (off) or >= 1"),
    ("min_p", -0.1, "in [0, 1]"),
    ("min_p", 1.1, "in [0, 1]"),
    ("seed", 1.5, "an int or None"),
    ("repetition_penalty", 0.0, "> 0"),
    ("presence_penalty", 2.5, "in [-2, 2]"),
    ("frequency_penalty", -2.1, "in [-2, 2]"),
    ("max_tokens", 0, ">= 1 or None"),
    ("min_tokens", -1, ">= 0"),
    ("stop", ["ok", ""], "non-empty strings"),
    ("stop_token_ids", [3, -1], "ints >= 0"),
    ("logprobs", -1, ">= 0 or None"),
    ("truncate_prompt_tokens", 0, ">= 1 or None"),
    ("output_kind", "delta", "a RequestOutputKind"),
])
def test_invalid_field_names_field_value_and_limit(field, value, limit):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    message = str(err.value)
    assert message.startswith(f"{field} must be {limit}, got ")
    assert repr(value) in message


def test_min_tokens_cannot_exceed_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\), got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)
    SamplingParams(max_tokens=None, min_tokens=5)


def test_the_example_message():
    with pytest.raises(ValueError, match=r"^temperature must be >= 0, got -0\.5$"):
        SamplingParams(temperature=-0.5)


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
