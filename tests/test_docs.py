"""The documentation site: it builds with ``--strict`` (no broken link, no missing reference),
its reference names every config key and every command-line option the code has, and its pages
render in a browser.

The site is built once for the module (about 10 s). Keys and options are enumerated here from
the dataclasses and the typer app directly, not through ``clozax.app.reference``, so a key the
generator skipped fails the test.
"""

from __future__ import annotations

import dataclasses
import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from browser import assert_drawn, needs_chromium, screenshot

pytestmark = pytest.mark.fast  # make test-fast; tests marked slow stay out

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                           "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-4000:]}"
    return out


def page_text(site: Path, page: str) -> str:
    """The page's visible text (tags dropped, entities decoded, whitespace collapsed)."""
    raw = (site / page).read_text()
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", raw)).split())


def test_the_config_reference_names_every_key_with_its_default(site):
    from clozax.train import config as config_lib
    from clozax.train.phase_config import PhaseConfig

    text = page_text(site, "reference/config.html")
    sections = {**config_lib.SECTIONS, "phases": PhaseConfig}
    keys = [(s, f) for s, cls in sections.items() for f in dataclasses.fields(cls)]
    assert len(keys) > 80
    missing = [f"{s}.{f.name}" for s, f in keys if f"{s}.{f.name}" not in text]
    assert not missing, f"config keys missing from the reference: {missing}"
    for dotted in sorted(config_lib.SPEED_ONLY):  # each speed-only key's row says so
        row = re.search(re.escape(dotted) + r" \S+(?: \| None)? \S+ (yes)?", text)
        assert row and row.group(1) == "yes", f"{dotted} is not marked speed-only"


def test_the_cli_reference_names_every_command_and_option(site):
    import typer.main

    from clozax.app.cli import app

    text = page_text(site, "reference/cli.html")
    group = typer.main.get_command(app)
    missing = []
    for name, command in group.commands.items():
        if f"clozax {name}" not in text:
            missing.append(f"command {name}")
        for param in command.params:
            if param.name == "help":
                continue
            flags = (param.opts + param.secondary_opts if param.param_type_name == "option"
                     else [param.name.upper()])
            missing += [f"{name} {flag}" for flag in flags if flag not in text]
    assert len(group.commands) >= 13
    assert not missing, f"missing from the command-line reference: {missing}"


def test_the_errors_page_lists_the_messages_the_code_raises(site):
    text = page_text(site, "errors.html")
    for message in ("is not divisible by train.microbatches",
                    "is being written by",
                    "non-finite loss",
                    "could not save the checkpoint at step"):
        assert message in text, message


def slug(heading: str) -> str:
    """A Markdown heading's anchor as MkDocs (toc) and GitHub make it."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"[\s]+", "-", text)


def test_the_readme_links_only_to_pages_and_headings_that_exist():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((?!https?://)([^)#]+)(?:#([^)]*))?\)", readme)
    assert len(links) >= 10
    missing = [path for path, _ in links if not (ROOT / path).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"
    for path, anchor in links:
        if anchor:
            headings = re.findall(r"^#+ (.+)$", (ROOT / path).read_text(), re.M)
            assert anchor in {slug(h) for h in headings}, f"{path} has no heading #{anchor}"
    assert len(readme.splitlines()) <= 200, "the README is a landing page: keep it short"


@pytest.mark.slow
@needs_chromium
@pytest.mark.parametrize("page", ["index.html", "reference/config.html"])
def test_pages_render_in_headless_chromium(site, page, tmp_path):
    image = screenshot((site / page).as_uri(), tmp_path / "shot.png", 1280, 1600)
    assert image.shape == (1600, 1280, 3)
    assert_drawn(image, max_background=0.95)
    header = image[:40].reshape(-1, 3).mean(axis=0)  # Material's coloured header bar
    assert header[2] > header[0] + 40, f"no theme header (mean colour {header}): unstyled"
