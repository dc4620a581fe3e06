"""IncrementalDetokenizer: deltas add up to the decoded text, stop strings cut it, nothing leaks.

Every tokenizer flavour runs every check: a byte-level BPE (GPT-2/Qwen style, splits multi-byte
characters across tokens), a metaspace "▁" tokenizer with byte fallback (Llama/sentencepiece
style, strips the first token's space), and "slow" wrappers of both that force the pure-Python
decoding path. The checks of prompts that end inside a character also run the embedded model's
tokenizer and the llama2c one (/work/shared/llama2c), and go through the engine with both models.
"""
import asyncio
import string

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from pagednb.engine.detokenizer import IncrementalDetokenizer
from pagednb.llm import DEFAULT_MODEL
from pagednb.sampling_params import RequestOutputKind, SamplingParams
from tiny import LLAMA2C, make_tokenizer

TEXTS = [
    "Once upon a time there was a cat named Tom.",
    "  leading spaces, double  spaces and trailing ",
    "café, naïve, Grüße",
    "東京 こんにちは",
    "emoji 🐱🐶🚀 and symbols ∑ ≤ ≥",
    "lines\n\nwith\ttabs\n",
]
PROMPT = "Once upon a time"


class SlowTokenizer:
    """Only what a slow (non-Rust) tokenizer offers: encode and decode."""

    def __init__(self, inner):
        self._inner = inner

    def encode(self, text):
        return self._inner.encode(text)

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=True):
        return self._inner.decode(ids, skip_special_tokens=skip_special_tokens)


class Encoded:
    """A `tokenizers.Tokenizer` with the encode/decode surface of an HF tokenizer."""

    def __init__(self, tok: Tokenizer):
        self.backend_tokenizer = tok

    def encode(self, text):
        return self.backend_tokenizer.encode(text).ids

    def decode(self, ids, skip_special_tokens=False):
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def metaspace_tokenizer() -> Tokenizer:
    """Llama-style: unigram pieces with "▁" for spaces, bytes for anything else (CJK, emoji)."""
    words = ["▁Once", "▁upon", "▁a", "▁time", "▁the", "▁cat", "▁named", "▁Tom", "▁caf", "é",
             "▁na", "ïve", "▁Gr", "üße", "▁dog", "▁Max", "▁"]
    chars = string.ascii_letters + string.digits + string.punctuation
    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    vocab += [(f"<0x{i:02X}>", -10.0) for i in range(256)]
    vocab += [(w, -1.0) for w in words] + [("▁" + c, -4.0) for c in string.ascii_letters]
    vocab += [(c, -5.0) for c in chars]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module", params=["bpe", "bpe-slow", "metaspace", "metaspace-slow"])
def tok(request, bpe):
    inner = bpe if request.param.startswith("bpe") else Encoded(metaspace_tokenizer())
    return SlowTokenizer(inner) if request.param.endswith("slow") else inner


def encode(tok, text):
    ids = tok.encode(text)
    return ids if isinstance(ids, list) else ids.ids


def stream(tok, prompt_ids, output_ids, params=None, chunk=1):
    """Feeds `output_ids` `chunk` at a time; returns the detokenizer, deltas and the stop string.

    Checks on the way that the deltas so far are always a prefix of the final text.
    """
    detok = IncrementalDetokenizer(tok, prompt_ids, params or SamplingParams())
    deltas, stop = [], None
    for i in range(0, len(output_ids), chunk):
        finished = i + chunk >= len(output_ids)
        stop = detok.update(output_ids[i:i + chunk], finished)
        deltas.append(detok.take_delta())
        assert "".join(deltas) == detok.output_text
        if stop is not None:
            break
    return detok, deltas, stop


def expected_text(tok, prompt_ids, output_ids, skip_special_tokens=True):
    """What the output adds to the decoded prompt (the leading-space rule)."""
    prompt = tok.decode(prompt_ids, skip_special_tokens=skip_special_tokens)
    full = tok.decode(prompt_ids + output_ids, skip_special_tokens=skip_special_tokens)
    assert full.startswith(prompt)
    return full[len(prompt):]


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_add_up_to_the_decoded_output(tok, text, chunk):
    out = encode(tok, text)
    for prompt in ([], encode(tok, PROMPT)):
        detok, deltas, stop = stream(tok, prompt, out, chunk=chunk)
        assert stop is None
        assert "".join(deltas) == detok.output_text == expected_text(tok, prompt, out)
        assert not any("\ufffd" in d for d in deltas)  # no half characters
    assert detok.output_text.strip() == text.strip()


def test_without_a_prompt_the_text_is_plain_decode(tok):
    out = encode(tok, TEXTS[4])
    detok, _, _ = stream(tok, [], out)
    assert detok.output_text == tok.decode(out, skip_special_tokens=True)


def test_first_output_token_keeps_its_leading_space(tok):
    prompt, full = encode(tok, "Once upon"), encode(tok, "Once upon a time")
    assert full[:len(prompt)] == prompt
    out = full[len(prompt):]
    assert stream(tok, prompt, out)[0].output_text == " a time"


def test_multi_byte_characters_appear_only_when_complete(tok):
    out = encode(tok, "🐱🐶")
    assert len(out) > 2  # the emoji are split across tokens
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    shown = []
    for token in out:
        detok.update([token], finished=False)
        shown.append(detok.take_delta())
    assert "".join(shown) == "🐱🐶"
    assert all(d in ("", "🐱", "🐶", "🐱🐶") for d in shown)


def test_finish_flushes_an_incomplete_character(tok):
    out = encode(tok, "ok 🐱")[:-1]  # the emoji's last byte never comes
    detok, deltas, _ = stream(tok, [], out)
    assert detok.output_text == "".join(deltas) == tok.decode(out, skip_special_tokens=True)
    assert detok.output_text.startswith("ok")


def stop_params(**kw):
    return SamplingParams(stop=["named Tom"], **kw)


def test_stop_string_split_across_tokens_is_found_and_cut(tok):
    out = encode(tok, TEXTS[0])
    detok, deltas, stop = stream(tok, [], out, stop_params())
    assert stop == "named Tom"
    assert detok.output_text == "".join(deltas) == "Once upon a time there was a cat "


def test_deltas_never_show_the_start_of_a_stop_string(tok):
    out = encode(tok, TEXTS[0])
    detok = IncrementalDetokenizer(tok, [], stop_params())
    for token in out:
        if detok.update([token], finished=False):
            break
        assert "nam" not in detok.output_text
        detok.take_delta()
    assert len(detok.output_text) == len("Once upon a time there was a cat ")


def test_include_stop_str_in_output(tok):
    out = encode(tok, TEXTS[0])
    detok, deltas, stop = stream(tok, [], out, stop_params(include_stop_str_in_output=True))
    assert stop == "named Tom"
    assert "".join(deltas) == detok.output_text == "Once upon a time there was a cat named Tom"


def test_earliest_of_several_stop_strings_wins(tok):
    out = encode(tok, TEXTS[0])
    detok, _, stop = stream(tok, [], out, SamplingParams(stop=["Tom", "cat", "upon a"]))
    assert stop == "upon a" and detok.output_text == "Once "


def test_stop_string_inside_an_emoji(tok):
    out = encode(tok, TEXTS[4])
    detok, deltas, stop = stream(tok, [], out, SamplingParams(stop=["🐶"]))
    assert stop == "🐶" and "".join(deltas) == detok.output_text == "emoji 🐱"


def test_stop_strings_wait_for_min_tokens(tok):
    out = encode(tok, TEXTS[0])
    params = SamplingParams(stop=["Once"], min_tokens=3, max_tokens=50)
    detok, _, stop = stream(tok, [], out, params)
    assert stop is None and detok.output_text == TEXTS[0]


def test_updates_after_a_stop_are_ignored(tok):
    out = encode(tok, TEXTS[0])
    detok, _, stop = stream(tok, [], out, SamplingParams(stop=["cat"]))
    assert stop == "cat"
    assert detok.update(encode(tok, " more"), finished=True) is None
    assert detok.output_text == "Once upon a time there was a "


@pytest.mark.parametrize("skip, shown", [(True, "Tom."), (False, "Tom.</s>")])
def test_skip_special_tokens(tok, skip, shown):
    eos = encode(tok, "</s>")
    out = encode(tok, "Tom.") + eos
    detok, deltas, _ = stream(tok, [], out, SamplingParams(skip_special_tokens=skip))
    assert "".join(deltas) == detok.output_text
    assert detok.output_text.lstrip() == shown


@pytest.mark.parametrize("text", TEXTS)
def test_final_only_without_stops_decodes_once_at_the_end(tok, text):
    out, prompt = encode(tok, text), encode(tok, PROMPT)
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams(
        output_kind=RequestOutputKind.FINAL_ONLY))
    for token in out[:-1]:
        assert detok.update([token], finished=False) is None
        assert detok.output_text == ""
    detok.update(out[-1:], finished=True)
    assert detok.output_text == detok.take_delta() == stream(tok, prompt, out)[0].output_text


# ---- prompts that end inside a multi-byte character -------------------------------------------------
# Token ids given directly can split a character between the prompt and the output (byte-level BPE
# splits every non-ASCII character into byte tokens; sentencepiece falls back to bytes). The rule (as
# in vLLM): the output starts right after the prompt's last whole character; the split character is
# emitted in the output once its bytes are complete.
SPLIT_TEXT = "I like 🐱 and café, naïve 東京 too."


@pytest.fixture(scope="module", params=["bpe", "bpe-slow", "metaspace", "metaspace-slow", "embedded", "llama2c"])
def any_tok(request, bpe):
    from transformers import AutoTokenizer
    name = request.param
    if name == "embedded":
        return AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    if name == "llama2c":
        if not LLAMA2C.is_dir():
            pytest.skip(f"the llama2c tokenizer is not in {LLAMA2C}")
        return AutoTokenizer.from_pretrained(LLAMA2C)
    inner = bpe if name.startswith("bpe") else Encoded(metaspace_tokenizer())
    return SlowTokenizer(inner) if name.endswith("slow") else inner


def mid_character_splits(tok, ids):
    """Every k where ids[:k] ends inside a character."""
    splits = [k for k in range(1, len(ids)) if tok.decode(ids[:k], skip_special_tokens=True).endswith("\ufffd")]
    assert splits, "the text has characters split across tokens"
    return splits


def after_prompt(tok, prompt_ids, output_ids):
    """The rule, computed apart from the detokenizer: the full decode, minus the prompt's whole characters."""
    head = tok.decode(prompt_ids, skip_special_tokens=True).rstrip("\ufffd")
    full = tok.decode(prompt_ids + output_ids, skip_special_tokens=True)
    assert full.startswith(head)
    return full[len(head):]


def final_only(tok, prompt_ids, output_ids):
    """What `generate` does: FINAL_ONLY, every token handed over at the end."""
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY))
    detok.update(output_ids, finished=True)
    return detok.output_text


@pytest.mark.parametrize("chunk", [1, 2])
def test_a_prompt_ending_mid_character_gives_the_character_to_the_output(any_tok, chunk):
    ids = encode(any_tok, SPLIT_TEXT)
    text = any_tok.decode(ids, skip_special_tokens=True)
    for k in mid_character_splits(any_tok, ids):
        prompt, out = ids[:k], ids[k:]
        head = any_tok.decode(prompt, skip_special_tokens=True).rstrip("\ufffd")
        detok, deltas, _ = stream(any_tok, prompt, out, chunk=chunk)
        assert "".join(deltas) == detok.output_text == final_only(any_tok, prompt, out) == text[len(head):], k
        assert not any("\ufffd" in d for d in deltas)  # the split character arrives whole, in the output


def test_bytes_the_output_never_completes_show_as_one_replacement_at_its_start(any_tok):
    ids = encode(any_tok, SPLIT_TEXT)
    other = encode(any_tok, " and more")
    for k in mid_character_splits(any_tok, ids):
        prompt = ids[:k]
        detok, deltas, _ = stream(any_tok, prompt, other)
        expected = after_prompt(any_tok, prompt, other)
        assert "".join(deltas) == detok.output_text == final_only(any_tok, prompt, other) == expected, k
        assert expected.startswith("\ufffd") and expected.rstrip().endswith("and more")


@pytest.mark.parametrize("model", ["embedded", "llama2c"])
def test_streamed_and_generated_text_agree_after_a_mid_character_prompt(model):
    """Through the engine: the streamed deltas, `generate`'s text and the stream's final output are one
    text, with no prompt text in it, for every prompt split inside a character."""
    from pagednb import LLM
    if model == "llama2c" and not LLAMA2C.is_dir():
        pytest.skip(f"the llama2c model is not in {LLAMA2C}")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(str(DEFAULT_MODEL if model == "embedded" else LLAMA2C), num_kv_blocks=64) as llm:
        tok = llm.get_tokenizer()
        ids = tok.encode(SPLIT_TEXT)
        prompts = [ids[:k] for k in mid_character_splits(tok, ids)]

        async def streamed(prompt):
            deltas, final = [], None
            async for out in llm.stream({"prompt_token_ids": prompt}, params):
                deltas.append(out.outputs[0].delta)
                final = out
            return "".join(deltas), final

        async def all_streamed():
            return await asyncio.gather(*(streamed(p) for p in prompts))
        generated = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, (joined, final), gen in zip(prompts, asyncio.run(all_streamed()), generated):
            completion = final.outputs[0]
            assert completion.token_ids == gen.outputs[0].token_ids  # greedy: the same tokens both ways
            assert joined == completion.text == gen.outputs[0].text == after_prompt(tok, prompt, completion.token_ids)
