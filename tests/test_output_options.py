"""The small output options vLLM users pass every day: detokenize, include_stop_str_in_output,
skip_special_tokens, spaces_between_special_tokens. Each is checked at the door and changes exactly the
text (never the tokens)."""
import asyncio

import pytest

from pagednb import LLM, SamplingParams
from pagednb.engine.detokenizer import IncrementalDetokenizer
from pagednb.sampling_params import RequestOutputKind

PROMPTS = ["Once upon a time", "The cat named Tom"]


@pytest.fixture(scope="module")
def llm():
    with LLM(num_kv_blocks=64, max_model_len=256) as llm:  # the embedded model: readable text
        yield llm


def _greedy(**options) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=20, **options)


def test_detokenize_false_gives_the_same_tokens_and_no_text(llm):
    with_text = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
    ids_only = llm.generate(PROMPTS, _greedy(detokenize=False), use_tqdm=False)
    for a, b in zip(with_text, ids_only):
        assert a.outputs[0].text  # the embedded model writes something
        assert b.outputs[0].text == "" and b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].finish_reason == a.outputs[0].finish_reason


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
def test_detokenize_false_streams_token_ids_with_empty_text(llm, kind):
    async def run():
        return [out async for out in llm.stream(PROMPTS[0], _greedy(detokenize=False, output_kind=kind))]

    outs = asyncio.run(run())
    assert len(outs) > 1 and outs[-1].finished
    assert all(o.outputs[0].text == "" and o.outputs[0].delta == "" for o in outs)
    streamed = [t for o in outs for t in o.outputs[0].token_ids] if kind is RequestOutputKind.DELTA \
        else outs[-1].outputs[0].token_ids
    assert streamed == llm.generate(PROMPTS[0], _greedy(), use_tqdm=False)[0].outputs[0].token_ids


def test_detokenize_false_refuses_stop_strings_but_takes_stop_token_ids():
    with pytest.raises(ValueError, match=r"stop strings need detokenize=True.*stop_token_ids"):
        SamplingParams(detokenize=False, stop=["."])
    SamplingParams(detokenize=False, stop_token_ids=[3])


@pytest.mark.parametrize("field", ["detokenize", "spaces_between_special_tokens", "skip_special_tokens",
                                   "include_stop_str_in_output"])
@pytest.mark.parametrize("value", [1, "yes", None])
def test_the_flags_take_bools_only_and_name_the_field(field, value):
    with pytest.raises(TypeError, match=rf"{field}.*True or False"):
        SamplingParams(**{field: value})


def test_include_stop_str_in_output_keeps_the_stop_string_and_stops_there(llm):
    full = llm.generate(PROMPTS[0], _greedy(), use_tqdm=False)[0].outputs[0].text
    stop = full.split()[2]  # a word the greedy text is known to reach
    cut = full[:full.index(stop)]
    kept = llm.generate(PROMPTS[0], _greedy(stop=[stop], include_stop_str_in_output=True), use_tqdm=False)[0]
    dropped = llm.generate(PROMPTS[0], _greedy(stop=[stop]), use_tqdm=False)[0]
    assert dropped.outputs[0].text == cut and kept.outputs[0].text == cut + stop
    assert kept.outputs[0].stop_reason == dropped.outputs[0].stop_reason == stop
    assert kept.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens_decides_whether_they_show(llm, skip):
    tok = llm.get_tokenizer()
    special = tok.convert_tokens_to_ids(tok.eos_token)
    words = tok.encode(" the cat", add_special_tokens=False)
    output = words + [special] + words
    detok = IncrementalDetokenizer(tok, tok.encode("Once upon a time"), _greedy(skip_special_tokens=skip))
    detok.update(output, finished=True)
    assert (tok.eos_token in detok.output_text) is not skip
    assert detok.output_text == _reference(tok, output, skip)


def _reference(tok, output: list[int], skip: bool) -> str:
    prompt = tok.encode("Once upon a time")
    return tok.decode(prompt + output, skip_special_tokens=skip)[len(tok.decode(prompt, skip_special_tokens=skip)):]


class SpacingTokenizer:
    """A slow tokenizer whose decode takes spaces_between_special_tokens, as HF's SentencePiece ones do:
    special tokens are joined to their neighbours with a space or without one."""

    vocab = ["a", "b", "<sep>"]

    def encode(self, text):
        return [self.vocab.index(c) for c in text.split()]

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=None,
               spaces_between_special_tokens=False):
        out = ""
        for i in ids:
            piece = self.vocab[i]
            special = piece.startswith("<")
            if special and skip_special_tokens:
                continue
            out += (" " if special and spaces_between_special_tokens and out else "") + piece
            if special and spaces_between_special_tokens:
                out += " "
        return out


class PlainSlowTokenizer(SpacingTokenizer):
    """A slow tokenizer without the option: it must not be handed it."""

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=None):
        return super().decode(ids, skip_special_tokens, clean_up_tokenization_spaces)


@pytest.mark.parametrize("spaces, expected", [(True, "a <sep> b"), (False, "a<sep>b")])
def test_spaces_between_special_tokens_reaches_a_slow_tokenizers_decode(spaces, expected):
    tok = SpacingTokenizer()
    params = _greedy(skip_special_tokens=False, spaces_between_special_tokens=spaces,
                     output_kind=RequestOutputKind.DELTA)
    detok = IncrementalDetokenizer(tok, [], params)
    deltas = []
    for token in tok.encode("a <sep> b"):
        detok.update([token], finished=False)
        deltas.append(detok.take_delta())
    detok.update([], finished=True)
    deltas.append(detok.take_delta())
    assert detok.output_text == "".join(deltas) == expected


def test_a_slow_tokenizer_without_the_option_still_decodes():
    detok = IncrementalDetokenizer(PlainSlowTokenizer(), [], _greedy(skip_special_tokens=False))
    detok.update([0, 2, 1], finished=True)
    assert detok.output_text == "a<sep>b"
