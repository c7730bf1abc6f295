"""A page as headless Chromium (Debian's package) draws it, for the tests that check a page
renders: the report's and the documentation site's."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

needs_chromium = pytest.mark.skipif(
    shutil.which("chromium") is None,
    reason="Debian chromium is not installed (apt-get install -y chromium)")


def screenshot(uri: str, shot: Path, width: int, height: int) -> np.ndarray:
    """The page at ``uri`` drawn at ``width`` x ``height``: (height, width, 3) uint8 RGB."""
    from PIL import Image

    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", f"--user-data-dir={profile}", f"--screenshot={shot}",
             f"--window-size={width},{height}", uri],
            check=True, capture_output=True, timeout=120)
    return np.asarray(Image.open(shot).convert("RGB"))


def assert_drawn(image: np.ndarray, max_background: float) -> None:
    """Not blank and not unstyled: many colours, and not mostly the first pixel's."""
    pixels = image.reshape(-1, 3)
    colours = np.unique(pixels, axis=0)
    assert len(colours) > 200, f"only {len(colours)} colours: a blank or unstyled page"
    background = np.all(pixels == pixels[0], axis=1).mean()
    assert background < max_background, "the page is mostly one colour"
