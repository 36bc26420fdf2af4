"""Accessibility: axe-core (axe-playwright-python) on every dashboard page, as each role sees it.

Each role signs in and walks its pages with the review data (organizations, people, conflicts,
ledger rows, a simulation, routable scenarios), charts drawn, forms in the states people meet
(a token shown once, a refused form, a wrong password). The test fails on any violation of a
WCAG 2.0/2.1 level A or AA rule whose impact is "serious" or "critical", naming the page, the
rule and the elements.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from django.urls import reverse
from playwright.sync_api import expect

from tests.browser.test_dashboard_browser import log_in

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, serialized_rollback=True)]

WCAG_TAGS = ["wcag2a", "wcag2aa", "wcag21a", "wcag21aa"]
FAILING_IMPACTS = {"serious", "critical"}
CHARTS_DRAWN = """() => [...document.querySelectorAll('div.plot')].every(e => e.dataset.rendered)"""
SERVER_ERROR_PAGE = Path(__file__).resolve().parents[2] / "templates" / "500.html"

Step = Callable[[object, str], object]


def visit(name: str, *args, query: str = "") -> Step:
    return lambda page, base: page.goto(f"{base}{reverse(name, args=args)}{query}")


def address(path: str) -> Step:
    return lambda page, base: page.goto(f"{base}{path}")


def wrong_password(page, base):
    page.goto(f"{base}{reverse('login')}")
    page.fill("#id_username", "nobody")
    page.fill("#id_password", "not-the-password")
    page.click("main button[type=submit]")
    page.wait_for_selector("main .error")


def sign_in_as(username: str) -> Step:
    return lambda page, base: log_in(page, base, username)


def route_a_query(page, base):
    page.goto(f"{base}{reverse('dashboard:routing')}")
    page.fill("#route-form input[name=q]", "will it rain in Rome tomorrow?")
    page.click("#route-form button[type=submit]")
    page.wait_for_selector("#candidates")


def approve_a_client(page, base):
    page.goto(f"{base}{reverse('dashboard:organization', args=['acme'])}")
    page.locator("table.clients-pending tr", has_text="acme-node-3").locator(
        "button", has_text="Approve").click()
    page.wait_for_selector("#issued-token")


def refused_enrollment(page, base):
    """A client name already taken: the refusal page."""
    page.goto(f"{base}{reverse('dashboard:organization', args=['acme'])}")
    page.fill("#enroll input[name=name]", "acme-node-1")
    page.click("#enroll button[type=submit]")
    page.wait_for_selector("main p.error")


def issue_a_token(page, base):
    page.goto(f"{base}{reverse('dashboard:tokens')}")
    page.fill("#id_label", "nightly export")
    page.click("#new-token button[type=submit]")
    page.wait_for_selector("#issued-token")


def wrong_current_password(page, base):
    page.goto(f"{base}{reverse('password_change')}")
    page.fill("#id_old_password", "not-my-password")
    page.fill("#id_new_password1", "Quiet-Orchard-Lamp-58")
    page.fill("#id_new_password2", "Quiet-Orchard-Lamp-58")
    page.click("main button[type=submit]")
    page.wait_for_selector("main .error")


def expired_form(page, base):
    """A form sent without its CSRF cookie: Django's 403 page (templates/403_csrf.html)."""
    page.goto(f"{base}{reverse('dashboard:tokens')}")
    page.context.clear_cookies(name="csrftoken")
    page.click("#new-token button[type=submit]")
    page.wait_for_selector("h1:text('Form expired')")


def close_the_open_round(page, base):
    """The overview with the Open round form (no round open)."""
    page.goto(f"{base}/")
    page.once("dialog", lambda dialog: dialog.accept())
    page.locator("#rounds tr", has_text="open").locator("button", has_text="Close").click()
    page.wait_for_selector("#open-round")


def server_error(page, base):
    page.set_content(SERVER_ERROR_PAGE.read_text())


SIGNED_OUT: list[tuple[str, Step]] = [
    ("sign-in", visit("login")),
    ("sign-in refused", wrong_password),
    ("server error", server_error),
]

SIGNED_IN: list[tuple[str, Step]] = [
    ("overview", visit("dashboard:overview")),
    ("organizations", visit("dashboard:organizations")),
    ("organization", visit("dashboard:organization", "acme")),
    ("conflicts", visit("dashboard:conflicts")),
    ("a conflict", visit("dashboard:conflicts", query="?round=2&organization=acme")),
    ("privacy", visit("dashboard:privacy")),
    ("privacy over budget", visit("dashboard:privacy", query="?epsilon=100")),
    ("accuracy", visit("dashboard:accuracy")),
    ("compendium", visit("dashboard:compendium")),
    ("compendium annex", visit("dashboard:compendium", query="?view=annex")),
    ("tool registry", visit("dashboard:tools")),
    ("routing", route_a_query),
    ("routing refused", visit("dashboard:routing", query="?q=rain&top_k=x")),
    ("audit", visit("dashboard:audit")),
    ("settings", visit("dashboard:settings")),
    ("API tokens", visit("dashboard:tokens")),
    ("API token issued", issue_a_token),
    ("change password", visit("password_change")),
    ("change password refused", wrong_current_password),
    ("log out", visit("logout")),
    ("not found", address("/no/such/page/")),
    ("form's action opened", visit("dashboard:round-open")),
    ("form expired", expired_form),
]

ROLES: dict[str, list[tuple[str, Step]]] = {
    "operator": [*SIGNED_IN, ("overview, no round open", close_the_open_round)],
    "acme-admin": [
        *SIGNED_IN,
        ("organization, token shown", approve_a_client),
        ("refusal", refused_enrollment),
    ],
    "acme-member": SIGNED_IN,
}


def serious_violations(page) -> list[str]:
    from axe_playwright_python.sync_playwright import Axe

    page.wait_for_function(CHARTS_DRAWN)
    results = Axe().run(page, options={
        "runOnly": {"type": "tag", "values": WCAG_TAGS}, "resultTypes": ["violations"],
    })
    return [
        f"{v['id']} ({v['impact']}): {v['help']} at "
        + "; ".join(" ".join(node["target"]) for node in v["nodes"])
        for v in results.response["violations"]
        if v["impact"] in FAILING_IMPACTS
    ]


@pytest.mark.parametrize("role", list(ROLES))
def test_every_page_passes_axe(role, review, page, live_server):
    base = live_server.url
    found = {}
    for name, step in SIGNED_OUT + [(f"signed in as {role}", sign_in_as(role))] + ROLES[role]:
        step(page, base)
        if violations := serious_violations(page):
            found[name] = violations
    assert not found, "\n".join(
        f"{name}: {violation}" for name, violations in found.items() for violation in violations)


def test_the_first_key_press_offers_a_skip_to_the_main_content(page, live_server):
    """The keyboard's first stops were the brand and the ten links of the navigation, on every
    page: there was no link past them to the page's content (WCAG 2.4.1)."""
    log_in(page, live_server.url, "operator")
    page.keyboard.press("Tab")
    skip = page.locator(":focus")
    expect(skip).to_have_text("Skip to main content")
    box = skip.bounding_box()
    assert box is not None and box["y"] >= 0 and box["width"] > 0  # on the screen when focused
    page.keyboard.press("Enter")
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.closest('main') !== null"), page.evaluate(
        "document.activeElement.outerHTML")


def test_form_errors_are_tied_to_their_fields(federation, page, live_server):
    """A refused sign-in or password change printed its error beside the form: the fields were
    neither marked invalid nor described by it, so a screen reader on the field heard nothing
    of it (WCAG 3.3.1)."""
    base = live_server.url
    wrong_password(page, base)
    for field in ("#id_username", "#id_password"):
        expect(page.locator(field)).to_have_attribute("aria-invalid", "true")
        expect(page.locator(field)).to_have_accessible_description(re.compile("didn't match"))
    log_in(page, base, "member")
    page.goto(f"{base}{reverse('password_change')}")
    page.fill("#id_old_password", "not-my-password")
    page.fill("#id_new_password1", "Quiet-Orchard-Lamp-58")
    page.fill("#id_new_password2", "Quiet-Orchard-Lamp-59")
    page.click("main button[type=submit]")
    page.wait_for_selector("main .error")
    old = page.locator("#id_old_password")
    expect(old).to_have_attribute("aria-invalid", "true")
    expect(old).to_have_accessible_description(re.compile("old password was entered incorrectly"))
    again = page.locator("#id_new_password2")
    expect(again).to_have_attribute("aria-invalid", "true")
    expect(again).to_have_accessible_description(re.compile("didn.t match"))
    expect(page.locator("#id_new_password1")).not_to_have_attribute("aria-invalid", "true")


def test_a_chart_is_a_figure_described_by_its_data(federation, page, live_server):
    """A chart was an image (role="img") named by its title: its data was out of a screen
    reader's reach, and the mode bar's buttons sat inside an image. It is a figure described by
    its data in words, its drawing hidden from the screen reader."""
    log_in(page, live_server.url, "operator")
    page.wait_for_selector("#bytes-per-client[data-rendered=true] svg.main-svg")
    chart = page.get_by_role("figure", name="Bytes each client sent per round")
    expect(chart).to_have_accessible_description(
        re.compile(r"Horizontal axis: round; vertical axis: sent \(kB\)\. acme/acme-node-1 \(line\): round 1: "))
    drawings = page.locator("#bytes-per-client svg.main-svg")
    assert drawings.count() > 0
    assert all(d.get_attribute("aria-hidden") == "true" for d in drawings.all())


LOW_CONTRAST_FIELDS = """() => {
    const rgba = c => c.match(/[\\d.]+/g).map(Number);
    const channel = v => (v /= 255) <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4;
    const luminance = ([r, g, b]) => 0.2126 * channel(r) + 0.7152 * channel(g) + 0.0722 * channel(b);
    const behind = e => { for (; e; e = e.parentElement) {
        const c = rgba(getComputedStyle(e).backgroundColor);
        if (c.length < 4 || c[3] > 0) return c; } return [255, 255, 255]; };
    return [...document.querySelectorAll('main input:not([type=hidden]):not([type=checkbox]), main select')]
        .map(e => { const [hi, lo] = [luminance(rgba(getComputedStyle(e).borderTopColor)),
                                      luminance(behind(e.parentElement))].sort((a, b) => b - a);
                    return [e.name, Math.round((hi + 0.05) / (lo + 0.05) * 100) / 100]; })
        .filter(([, ratio]) => ratio < 3);
}"""


def test_form_fields_are_outlined_at_three_to_one(federation, page, live_server):
    """A text field or select was outlined in #b9c0cc, 1.8:1 against the white card and less on
    the page's grey: hard to see where to type (WCAG 1.4.11 asks 3:1)."""
    base = live_server.url
    page.goto(f"{base}{reverse('login')}")
    assert page.evaluate(LOW_CONTRAST_FIELDS) == []
    log_in(page, base, "operator")
    for name in ("dashboard:audit", "dashboard:compendium", "dashboard:tools"):
        page.goto(f"{base}{reverse(name)}")
        assert page.evaluate(LOW_CONTRAST_FIELDS) == [], name


def test_the_server_error_page_has_a_main_landmark_and_the_token_table_named_columns(
        federation, page, live_server):
    """Below "serious", two findings of axe: the server error page's text lay outside any
    landmark (no <main>), and the API tokens table's last column, its Revoke buttons, had an
    empty header."""
    from axe_playwright_python.sync_playwright import Axe

    rules = {"runOnly": ["landmark-one-main", "region", "empty-table-header"]}
    server_error(page, live_server.url)
    assert Axe().run(page, options=rules).violations_count == 0, "500.html"
    log_in(page, live_server.url, "member")
    issue_a_token(page, live_server.url)
    results = Axe().run(page, options=rules)
    assert results.violations_count == 0, results.generate_report()
