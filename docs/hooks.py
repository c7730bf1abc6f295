"""MkDocs hook: replaces ``<!-- reference:NAME -->`` in a page with the reference generated from
the code (``clozax.app.reference``), so the command-line, config and error pages cannot drift."""

from __future__ import annotations

import re

from clozax.app import reference

MARKER = re.compile(r"<!-- reference:(\w+) -->")


def on_page_markdown(markdown: str, **_) -> str:
    return MARKER.sub(lambda m: reference.render(m.group(1)), markdown)
