"""Fixtures for the browser tests: Debian's Chromium driven by Playwright against `live_server`.

The data is stored before Playwright starts and the test bodies only drive the browser: Playwright's
sync API runs an event loop in this thread, under which Django refuses ORM calls.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.browser.chromium import LAUNCH_ARGS, ensure_chromium
from tests.dashboard_data import add_review_data, build_federation

SCREENSHOTS = Path(__file__).resolve().parents[2] / "screenshots"


@pytest.fixture(scope="session")
def chromium_path() -> Path:
    return ensure_chromium()


@pytest.fixture
def federation(transactional_db):
    return build_federation()


@pytest.fixture
def review(federation):
    """Organization people, conflicts, ledger rows, a simulation and routable scenarios."""
    from routing.services import forget_published_version

    forget_published_version()
    review = add_review_data(federation, embed=True)
    yield review
    forget_published_version()


@pytest.fixture
def browser(chromium_path, federation, live_server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(chromium_path), headless=True, args=LAUNCH_ARGS
        )
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser):
    """A page that fails its test if the browser refused anything under the
    Content-Security-Policy (an inline script, a style or image source it does not allow)."""
    context = browser.new_context(viewport={"width": 1366, "height": 860})
    page = context.new_page()
    page.set_default_timeout(20_000)
    refused = []
    page.on("console", lambda m: refused.append(f"{m.text} at {m.location}") if "Content Security Policy" in m.text else None)
    yield page
    context.close()
    assert not refused, refused


@pytest.fixture
def shoot():
    """Save a full-page screenshot to screenshots/<name>.png for review."""
    SCREENSHOTS.mkdir(exist_ok=True)

    def save(page, name: str) -> Path:
        path = SCREENSHOTS / f"{name}.png"
        page.screenshot(path=str(path), full_page=True)
        return path

    return save
