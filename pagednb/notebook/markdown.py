"""A small, safe Markdown-to-HTML converter for model output.

Model output is untrusted text and ipywidgets' HTML widget inserts its value as raw HTML, so every
character of the text is escaped first; only the markup this module generates is real HTML. It covers
what chat models write (paragraphs, headings, lists, fenced and inline code, bold, italics, http(s)
links) and tolerates half-written input, since it re-renders a growing stream: an unclosed code fence
shows the rest as code, an unclosed `**` stays literal.
"""
from __future__ import annotations

import html
import re

_FENCE = re.compile(r"^\s*```")
_HEADING = re.compile(r"^(#{1,6})\s+(.*)$")
_BULLET = re.compile(r"^\s*[-*+]\s+(.*)$")
_NUMBERED = re.compile(r"^\s*\d+[.)]\s+(.*)$")
_BOLD = re.compile(r"\*\*(?=\S)(.+?)(?<=\S)\*\*|__(?=\S)(.+?)(?<=\S)__")
_ITALIC = re.compile(r"(?<![\w*])\*(?=\S)([^*]+?)(?<=\S)\*(?![\w*])|(?<!\w)_(?=\S)([^_]+?)(?<=\S)_(?!\w)")
# Runs on escaped text: the URL may contain &amp; but never a quote or angle bracket.
_LINK = re.compile(r"\[([^\]]+)\]\((https?://[^\s)]+)\)")


def escape(text: str) -> str:
    return html.escape(text, quote=True)


def plain_to_html(text: str) -> str:
    """Plain text as a preformatted block, with wrapping."""
    return f'<pre style="white-space:pre-wrap;margin:0;font-family:inherit">{escape(text)}</pre>'


def markdown_to_html(text: str) -> str:
    """Converts Markdown to HTML; all of `text` is escaped, so it cannot inject markup or scripts."""
    out: list[str] = []
    paragraph: list[str] = []
    list_tag: str | None = None
    code: list[str] | None = None  # lines of an open fenced code block

    def close_paragraph() -> None:
        if paragraph:
            out.append("<p>" + "<br>".join(_inline(line) for line in paragraph) + "</p>")
            paragraph.clear()

    def close_list() -> None:
        nonlocal list_tag
        if list_tag:
            out.append(f"</{list_tag}>")
            list_tag = None

    def close_blocks() -> None:
        close_paragraph()
        close_list()

    for line in text.split("\n"):
        if code is not None:
            if _FENCE.match(line):
                out.append(_code_block(code))
                code = None
            else:
                code.append(line)
            continue
        if _FENCE.match(line):
            close_blocks()
            code = []
            continue
        heading, bullet, numbered = _HEADING.match(line), _BULLET.match(line), _NUMBERED.match(line)
        if heading:
            close_blocks()
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
            close_blocks()
        else:
            close_list()
            paragraph.append(line)
    close_blocks()
    if code is not None:  # still streaming inside a fence
        out.append(_code_block(code))
    return "".join(out)


def _code_block(lines: list[str]) -> str:
    return f"<pre><code>{escape(chr(10).join(lines))}</code></pre>"


def _inline(line: str) -> str:
    """Inline markup on one line; code spans are cut out first so nothing inside them is formatted."""
    pieces = line.split("`")
    if len(pieces) % 2 == 0:  # an unmatched backtick: keep it literal
        pieces[-2] += "`" + pieces.pop()
    return "".join(f"<code>{escape(p)}</code>" if i % 2 else _emphasis(escape(p)) for i, p in enumerate(pieces))


def _emphasis(escaped: str) -> str:
    # Most lines have no markers at all: the substring checks skip the (slower) regexes for them,
    # which matters since a stream re-renders its whole text up to 30 times a second.
    if "](" in escaped:
        escaped = _LINK.sub(r'<a href="\2" target="_blank" rel="noopener noreferrer">\1</a>', escaped)
    if "*" not in escaped and "_" not in escaped:
        return escaped
    escaped = _BOLD.sub(lambda m: f"<strong>{m.group(1) or m.group(2)}</strong>", escaped)
    return _ITALIC.sub(lambda m: f"<em>{m.group(1) or m.group(2)}</em>", escaped)
