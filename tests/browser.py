"""A headless Chromium page for tests that check what a browser makes of our HTML.

    from browser import open_page           # tests/ is on sys.path, as for worlds and clusters
    with open_page() as view:                 # skips the test when playwright or chromium is missing
        view.page.goto(path.as_uri())
        assert view.errors == []              # console errors and uncaught exceptions, as they came
        assert view.remote == []              # anything the page tried to fetch from a network

Debian's chromium, never Playwright's own download (it cannot be fetched in the test sandbox);
LONGRUN_CHROMIUM names another binary. The flags keep the browser off the network by itself
(no component updates, sync or QUIC probes): the tests run in a loopback-only namespace, and a
background request failing there must not read as the page's own error.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
LOCAL_SCHEMES = ("file:", "data:", "blob:", "about:")


def chromium() -> str | None:
    """The chromium binary to drive, or None where there is none."""
    named = os.environ.get("LONGRUN_CHROMIUM")
    if named:
        return named if os.access(named, os.X_OK) else None
    for candidate in ("/usr/bin/chromium", "chromium", "chromium-browser"):
        found = shutil.which(candidate)
        if found:
            return found
    return None


@dataclass
class Watched:
    page: Any  # playwright.sync_api.Page
    errors: list[str] = field(default_factory=list)
    remote: list[str] = field(default_factory=list)


@contextmanager
def open_page(width: int = 1400, height: int = 900) -> Iterator[Watched]:
    """A fresh page in a fresh headless chromium, with its errors and remote requests recorded."""
    try:
        from playwright.sync_api import Error, sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright; no browser download needed)")
    binary = chromium()
    if binary is None:
        pytest.skip("no chromium here (apt-get install chromium, or set LONGRUN_CHROMIUM)")
    with sync_playwright() as p:
        try:
            browser = p.chromium.launch(executable_path=binary, args=CHROMIUM_ARGS)
        except Error as exc:  # a chromium too old for this playwright, or one that cannot start here
            pytest.skip(f"chromium at {binary} did not start: {str(exc).splitlines()[0]}")
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            watched = Watched(page)
            page.on("console", lambda m: m.type == "error" and watched.errors.append(f"console: {m.text}"))
            page.on("pageerror", lambda exc: watched.errors.append(f"page error: {exc}"))
            page.on("request", lambda r: r.url.startswith(LOCAL_SCHEMES) or watched.remote.append(r.url))
            yield watched
        finally:
            browser.close()


@pytest.fixture
def browser_page() -> Iterator[Watched]:
    with open_page() as watched:
        yield watched
