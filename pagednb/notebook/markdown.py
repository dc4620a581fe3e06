"""A small, safe Markdown-to-HTML converter for model output.

Model output is untrusted text and ipywidgets' HTML widget inserts its value as raw HTML, so every
character of the text is escaped; only the markup this module generates is real HTML. It covers what
chat models write (paragraphs, headings, lists, fenced and inline code, bold, italics, http(s) links)
and accepts *any* string, since it re-renders a growing stream that is half-written most of the time:
an unclosed code fence shows the rest as code, an unmatched backtick or `**` stays literal.

Why it cannot produce broken HTML: every tag is opened and closed by the same function call around
an already-rendered piece (blocks line by line, inline spans by recursion on the raw text), and every
piece of raw text goes through `escape` exactly once. No pattern ever runs over generated HTML, so a
marker inside a link's URL cannot split a tag. Only markup characters (`#`, list markers, backticks,
`*`, `_`, link brackets, blank space) are ever dropped from the text; `<`, `>`, `&` and quotes always
come out as entities.
"""
from __future__ import annotations

import html
import re

_FENCE_OPEN = re.compile(r"^\s*```\s*([^`]*?)\s*$")
_FENCE_CLOSE = re.compile(r"^\s*```\s*$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*)$")
_BULLET = re.compile(r"^\s*[-*+]\s+(.*)$")
_NUMBERED = re.compile(r"^\s*\d+[.)]\s+(.*)$")
_BACKTICKS = re.compile(r"`+")
# http(s) only (no javascript:); the URL is escaped like any text, so a quote in it cannot end href.
_LINK = re.compile(r"\[([^\]\n]+)\]\((https?://[^\s()<>]+)\)")
# One pattern for all emphasis, so one leftmost search finds the next span: bold before italics.
_EMPHASIS = re.compile(
    r"\*\*(?=\S)(?P<b1>.+?)(?<=\S)\*\*"
    r"|__(?=\S)(?P<b2>.+?)(?<=\S)__"
    r"|(?<![\w*])\*(?=\S)(?P<i1>[^*]+?)(?<=\S)\*(?![\w*])"
    r"|(?<![\w_])_(?=\S)(?P<i2>[^_]+?)(?<=\S)_(?![\w_])")
# Nesting deeper than this renders the rest literally: bounded recursion on any input.
_MAX_NESTING = 8


def escape(text: str) -> str:
    return html.escape(text, quote=True)


def plain_to_html(text: str) -> str:
    """Plain text as a preformatted block, with wrapping."""
    return f'<pre style="white-space:pre-wrap;margin:0;font-family:inherit">{escape(text)}</pre>'


def markdown_to_html(text: str) -> str:
    """Converts Markdown to well-formed HTML; all of `text` is escaped, so it cannot inject markup."""
    out: list[str] = []
    paragraph: list[str] = []
    list_tag: str | None = None
    code: list[str] | None = None  # lines of an open fenced code block
    language = ""

    def close_paragraph() -> None:
        if paragraph:
            out.append("<p>" + "<br>".join(_inline(line) for line in paragraph) + "</p>")
            paragraph.clear()

    def close_list() -> None:
        nonlocal list_tag
        if list_tag:
            out.append(f"</{list_tag}>")
            list_tag = None

    for line in text.split("\n"):
        if code is not None:
            if _FENCE_CLOSE.match(line):
                out.append(_code_block(code, language))
                code = None
            else:
                code.append(line)
            continue
        fence = _FENCE_OPEN.match(line)
        heading, bullet, numbered = _HEADING.match(line), _BULLET.match(line), _NUMBERED.match(line)
        if fence:
            close_paragraph()
            close_list()
            code, language = [], fence.group(1)
        elif heading:
            close_paragraph()
            close_list()
            level = len(heading.group(1))
            out.append(f"<h{level}>{_inline(heading.group(2))}</h{level}>")
        elif bullet or numbered:
            close_paragraph()
            tag = "ul" if bullet else "ol"
            if list_tag != tag:
                close_list()
                out.append(f"<{tag}>")
                list_tag = tag
            out.append(f"<li>{_inline((bullet or numbered).group(1))}</li>")
        elif not line.strip():
            close_paragraph()
            close_list()
        else:
            close_list()
            paragraph.append(line)
    close_paragraph()
    close_list()
    if code is not None:  # still streaming inside a fence
        out.append(_code_block(code, language))
    return "".join(out)


def _code_block(lines: list[str], language: str) -> str:
    # The info string is kept (as a class, escaped) so that no character of the text is lost.
    attribute = f' class="language-{escape(language)}"' if language else ""
    return f"<pre><code{attribute}>{escape(chr(10).join(lines))}</code></pre>"


def _inline(line: str) -> str:
    """One line's inline markup. Code spans are cut out first (a run of n backticks closes at the next
    run of exactly n, as in CommonMark) so nothing inside them is formatted; an unmatched run is text."""
    out: list[str] = []
    text_start = 0
    position = 0
    while (opening := _BACKTICKS.search(line, position)) is not None:
        closing = _BACKTICKS.search(line, opening.end())
        while closing is not None and len(closing.group()) != len(opening.group()):
            closing = _BACKTICKS.search(line, closing.end())
        if closing is None:  # unmatched: literal backticks, go on after them
            position = opening.end()
            continue
        out.append(_links(line[text_start:opening.start()]))
        out.append(f"<code>{escape(line[opening.end():closing.start()])}</code>")
        text_start = position = closing.end()
    out.append(_links(line[text_start:]))
    return "".join(out)


def _links(text: str) -> str:
    """http(s) links, their labels with emphasis; links come before emphasis so a `_` or `*` in a URL
    stays part of it."""
    if "](" not in text:  # most text has no links: skip the regex (streams re-render up to 30 times/s)
        return _emphasis(text)
    out: list[str] = []
    start = 0
    for link in _LINK.finditer(text):
        out.append(_emphasis(text[start:link.start()]))
        out.append(f'<a href="{escape(link.group(2))}" target="_blank" rel="noopener noreferrer">'
                   f"{_emphasis(link.group(1))}</a>")
        start = link.end()
    out.append(_emphasis(text[start:]))
    return "".join(out)


def _emphasis(text: str, depth: int = 0) -> str:
    """Bold and italics: each span's tags wrap its rendered inside, so they always balance."""
    if depth >= _MAX_NESTING or ("*" not in text and "_" not in text):
        return escape(text)
    out: list[str] = []
    start = 0
    for span in _EMPHASIS.finditer(text):
        tag = "strong" if span.group("b1") is not None or span.group("b2") is not None else "em"
        inside = next(group for group in span.groups() if group is not None)
        out.append(escape(text[start:span.start()]))
        out.append(f"<{tag}>{_emphasis(inside, depth + 1)}</{tag}>")
        start = span.end()
    out.append(escape(text[start:]))
    return "".join(out)
