"""The embedded default model: `LLM()` loads it offline through the ordinary HF loading path, and it
tells short, grammatical stories about the animal and name the prompt asks for — including the two
(animal, name) pairs the training corpus never contains."""
import re
import subprocess
import sys

import pytest

from pagednb import LLM, SamplingParams
from pagednb.llm import DEFAULT_MODEL

GREEDY = SamplingParams(temperature=0, max_tokens=200)


@pytest.fixture(scope="module")
def llm():
    with LLM() as engine:
        yield engine


def reply(llm, prompt):
    return llm.chat([{"role": "user", "content": prompt}], GREEDY, use_tqdm=False)[0].outputs[0]


def assert_grammatical_story(text: str, animal: str, name: str) -> None:
    # A sentence ends at a full stop, or at a quoted ?/! followed by a capital ("Can I play too?" Then);
    # a quoted exclamation inside a sentence (He said "woof!" and ...) does not end it.
    sentences = re.split(r'(?<=\.)\s+|(?<=[?!]")\s+(?=[A-Z])', text.strip())
    assert all(s.endswith((".", '?"', '!"')) for s in sentences), "text must be whole sentences"
    assert 4 <= len(sentences) <= 12, "a short story"
    assert all(s[0].isupper() for s in sentences), "sentences start with a capital letter"
    assert text.strip().endswith("The end.")
    assert re.search(rf"\b(an?) (\w+ )?{animal} (named|called) {name}\b", sentences[0]), sentences[0]
    assert text.count(name) >= 3, "the story is about the named animal throughout"
    assert not re.search(r"\ba [aeiou]|\ban [^aeiou\W]", text), "a/an agree with the next word"
    assert not re.search(r"\b(\w+) \1\b", text), "no doubled words"


@pytest.mark.parametrize("animal, name", [("cat", "Tom"), ("dog", "Max")])
def test_held_out_story_prompts_get_the_story_asked_for(llm, animal, name):
    out = reply(llm, f"Tell me a story about a {animal} named {name}.")
    assert out.finish_reason == "stop" and len(out.token_ids) < GREEDY.max_tokens  # ended with EOS
    assert out.token_ids[-1] in llm.engine.eos_token_ids
    assert_grammatical_story(out.text, animal, name)


def test_other_animals_and_simple_questions(llm):
    assert_grammatical_story(reply(llm, "Tell me a story about an owl named Lily.").text, "owl", "Lily")
    assert reply(llm, "What is 7 plus 5?").text == "7 plus 5 is 12."


def test_loads_through_the_standard_hf_folder_layout():
    names = {p.name for p in DEFAULT_MODEL.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "README.md"} <= names
    assert sum(p.stat().st_size for p in DEFAULT_MODEL.iterdir()) < 8 * 2**20
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(DEFAULT_MODEL).chat_template


def test_the_readme_command_streams_a_reply_in_the_terminal():
    result = subprocess.run([sys.executable, "-m", "pagednb", "Tell me a story about a cat named Tom."],
                            capture_output=True, text=True, timeout=300, env={"HF_HUB_OFFLINE": "1",
                                                                               "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert "cat" in result.stdout and "Tom" in result.stdout and result.stdout.strip().endswith("The end.")
    assert "finish_reason=stop" in result.stderr
