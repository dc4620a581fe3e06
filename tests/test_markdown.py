"""The Markdown renderer of the notebook views accepts any string (a stream re-renders half-written
text many times a second) and always returns well-formed HTML with every character of the text escaped."""
import re
from html.parser import HTMLParser

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagednb.notebook.markdown import markdown_to_html

GENERATED_TAGS = {"p", "br", "h1", "h2", "h3", "h4", "h5", "h6", "ul", "ol", "li", "pre", "code", "strong", "em", "a"}
VOID_TAGS = {"br"}
ENTITY = re.compile(r"&(?:amp|lt|gt|quot|#x27);")

# Pieces models write mid-stream, half-finished markup and hostile HTML among them.
FRAGMENTS = ["`", "``", "```", "```py", "*", "**", "_", "__", "# ", "###### ", "- ", "* ", "+ ", "1. ", "2) ",
             "[", "]", "(", ")", "](", "[a](https://x.org/", "[b](https://e.com/a_b_*c*)", "javascript:",
             "<", ">", "&", "&amp;", "&lt;", '"', "'", "<script>alert(1)</script>", "<b>", "</p>", "\n", "\n\n",
             " ", "  ", "\t", "\r", "x", "word", "é", "日本", "😀", "\u200b", "\x00", "\u2028"]
markdownish = st.lists(st.sampled_from(FRAGMENTS), max_size=60).map("".join)
texts = st.one_of(st.text(), st.text(alphabet="`*_#-+[]()<>&\"' \n1.)xé😀"), markdownish)


class TagBalance(HTMLParser):
    """Checks that every generated tag is known and closed in order."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.problems: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag not in GENERATED_TAGS:
            self.problems.append(f"unexpected tag <{tag}>")
        if tag not in VOID_TAGS:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack.pop() != tag:
            self.problems.append(f"unbalanced </{tag}>")


def check_well_formed(text: str) -> None:
    out = markdown_to_html(text)
    parser = TagBalance()
    parser.feed(out)
    parser.close()
    assert not parser.problems and not parser.stack, (text, out, parser.problems, parser.stack)
    # Outside the generated tags no raw markup character is left, and every & starts an entity.
    outside_tags = re.sub(r"</?(?:%s)(?: [^<>]*)?>" % "|".join(GENERATED_TAGS), "", out)
    assert "<" not in outside_tags and ">" not in outside_tags, (text, out)
    assert "&" not in ENTITY.sub("", outside_tags), (text, out)
    # Each <, >, & and quote of the input comes out as exactly one entity: none lost, none left raw.
    for char, entity in (("<", "&lt;"), (">", "&gt;"), ("&", "&amp;"), ('"', "&quot;"), ("'", "&#x27;")):
        assert out.count(entity) == text.count(char), (char, text, out)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts)
def test_any_text_renders_to_well_formed_escaped_html(text):
    check_well_formed(text)


@settings(max_examples=200, deadline=None)
@given(texts)
def test_every_prefix_of_a_stream_renders(text):
    """A stream renders each prefix of its text in turn: every one of them is well-formed too."""
    for end in range(0, len(text) + 1, max(1, len(text) // 8)):
        check_well_formed(text[:end])


def test_the_half_written_cases_models_produce():
    assert markdown_to_html("Use `pri") == "<p>Use `pri</p>"  # an odd number of backticks stays literal
    assert markdown_to_html("a ``b`c`` d") == "<p>a <code>b`c</code> d</p>"
    assert markdown_to_html("**bold") == "<p>**bold</p>"
    assert markdown_to_html("```python\nx = 1 < 2") == '<pre><code class="language-python">x = 1 &lt; 2</code></pre>'
    assert markdown_to_html("```\n```js\n```") == "<pre><code>```js</code></pre>"  # only a bare fence closes
    link = markdown_to_html("**see [the_docs](https://e.com/a_b_/**x**)**")
    assert 'href="https://e.com/a_b_/**x**"' in link  # emphasis never reaches into a URL


def test_deep_nesting_is_bounded():
    text = "".join("*_" if i % 2 else "**" for i in range(2000)) + "x" + "**" * 2000
    check_well_formed(text)
