"""The dashboard in a real browser: Debian's Chromium, headless, driven by Playwright."""

from __future__ import annotations

import pytest
from django.urls import reverse

from tests.dashboard_data import PASSWORD

# serialized_rollback: the flush after each live-server test restores the rows that migrations
# created (the declared numeric fields), so later transactional tests still find them.
pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, serialized_rollback=True)]

PAGES = ["dashboard:overview", "dashboard:compendium", "dashboard:tools"]


def log_in(page, base_url: str, username: str) -> None:
    page.goto(f"{base_url}/")
    assert page.url.startswith(f"{base_url}{reverse('login')}")
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(f"{base_url}/")


def test_operator_tour(page, live_server, shoot):
    base = live_server.url
    page.goto(f"{base}/")
    shoot(page, "login")
    log_in(page, base, "operator")

    # overview: tables and two rendered plotly charts
    assert page.locator("h1").inner_text() == "Federation overview"
    page.wait_for_selector("#bytes-per-client[data-rendered=true] svg.main-svg")
    traces = page.locator("#bytes-per-client g.trace.scatter")
    assert traces.count() == 4
    line = page.locator("#bytes-per-client g.trace.scatter path.js-line").first
    assert len(line.get_attribute("d") or "") > 10
    page.wait_for_selector("#participation[data-rendered=true] svg.main-svg")
    assert page.locator("#participation g.trace.bars path").count() >= 3
    assert page.locator("#rounds tbody tr").count() == 4
    assert "acme-node-1" in page.locator("#clients").inner_text()
    shoot(page, "overview")

    # compendium: latest round, then a search, then a chosen round
    page.click("nav >> text=Compendium")
    page.wait_for_url(f"{base}{reverse('dashboard:compendium')}")
    assert page.locator("article.tool").count() == 3
    assert "Unpublished merge result scenario" in page.content()  # operator sees round 3
    shoot(page, "compendium")
    page.fill("input[name=q]", "airports")
    page.click("form.toolbar button[type=submit]")
    page.wait_for_url("**q=airports**")
    assert page.locator("article.tool").count() == 1
    assert page.locator("article.tool h2").inner_text().startswith("flights")
    card = page.locator("article.tool").inner_text()
    assert "since round 1" in card and "since round 2" in card  # when each scenario appeared
    shoot(page, "compendium-search")
    page.select_option("select[name=round]", "1")
    page.click("form.toolbar button[type=submit]")
    page.wait_for_url("**round=1**")
    assert "round 1" in page.locator("p.meta").inner_text()
    assert "Change the date" not in page.content()

    # tool registry
    page.click("nav >> text=Tool registry")
    assert page.locator("#tools tbody tr").count() == 33
    page.fill("input[name=q]", "forecast")
    page.click("form.toolbar button[type=submit]")
    page.wait_for_url("**q=forecast**")
    assert page.locator("#tools tbody tr").count() == 1
    shoot(page, "tools")

    # log out: back on the login page, and the overview needs a login again
    page.click("text=Log out")
    page.wait_for_url(f"{base}{reverse('login')}")
    page.goto(f"{base}/")
    assert page.url.startswith(f"{base}{reverse('login')}?next=/")


def test_anonymous_user_is_redirected_to_login_everywhere(page, live_server):
    for name in PAGES:
        url = reverse(name)
        page.goto(f"{live_server.url}{url}")
        assert page.url == f"{live_server.url}{reverse('login')}?next={url}"
        assert page.locator("#id_username").is_visible()


def test_member_without_organizations_sees_no_organization_data(page, live_server, shoot):
    log_in(page, live_server.url, "member")
    text = page.locator("main").inner_text()
    for secret in ("Acme Research", "Globex Health", "acme-node", "globex-node"):
        assert secret not in text
    assert "not a member of any organization" in text
    assert page.locator("#bytes-per-client").count() == 0
    page.wait_for_selector("#participation[data-rendered=true] svg.main-svg")
    shoot(page, "overview-member")
    page.goto(f"{live_server.url}{reverse('dashboard:compendium')}")
    assert "Unpublished merge result scenario" not in page.content()  # round 3 is not published
    assert "round 2" in page.locator("p.meta").inner_text()
    page.goto(f"{live_server.url}{reverse('dashboard:tools')}")
    assert "calls/round" in page.locator("main").inner_text()  # migration rows survived the flushes


def test_back_to_the_sign_in_page_after_signing_in_says_who_is_signed_in(page, live_server):
    """Signed in through a page's redirect (/privacy/ → the sign-in → /privacy/), the browser's
    Back showed the sign-in page again saying 'Your account doesn't have access to that page':
    untrue, as no page sends a signed-in person to sign in (one it may not see answers 403 or
    404). It now says who is signed in, with the way on to the page."""
    base = live_server.url
    page.goto(f"{base}{reverse('dashboard:privacy')}")
    page.fill("#id_username", "operator")
    page.fill("#id_password", PASSWORD)
    page.click("main button[type=submit]")
    page.wait_for_url(f"{base}{reverse('dashboard:privacy')}")
    page.go_back()
    page.wait_for_selector("#id_username")
    text = page.locator("main").inner_text()
    assert "have access" not in text
    assert "signed in as operator" in text
    page.click("#signed-in a")
    page.wait_for_url(f"{base}{reverse('dashboard:privacy')}")
