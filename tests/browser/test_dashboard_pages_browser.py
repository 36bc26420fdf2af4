"""The organization, conflict, audit, privacy, accuracy and routing pages in a real browser."""

from __future__ import annotations

import threading

import pytest
from django.urls import reverse

from federation.models import Round
from tests.browser.test_dashboard_browser import log_in
from tests.dashboard_data import PASSWORD

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, serialized_rollback=True)]


def go(page, base, name, *args):
    response = page.goto(f"{base}{reverse(name, args=args)}")
    return response


def test_organization_admin_tour(review, page, live_server, shoot):
    base = live_server.url
    log_in(page, base, "acme-admin")

    # organizations: only Acme is listed
    page.click("nav >> text=Organizations")
    assert page.locator("#organizations tbody tr").count() == 1
    assert "Globex" not in page.locator("main").inner_text()
    shoot(page, "organizations")
    page.click("#organizations >> text=Acme Research")
    page.wait_for_url(f"{base}{reverse('dashboard:organization', args=['acme'])}")
    page.wait_for_selector("#edge-figures[data-rendered=true] svg.main-svg")
    assert page.locator("#edge-figures g.trace.bars path").count() >= 2
    shoot(page, "organization")

    # enroll, then approve: the token is shown once
    page.fill("#enroll input[name=name]", "acme-lab-9")
    page.fill("#enroll input[name=contact]", "lab9@acme.example")
    page.click("#enroll button[type=submit]")
    page.wait_for_url(f"{base}{reverse('dashboard:organization', args=['acme'])}")
    assert "acme-lab-9 enrolled" in page.locator(".messages").inner_text()
    row = page.locator("table.clients-pending tr", has_text="acme-lab-9")
    row.locator("button", has_text="Approve").click()
    page.wait_for_selector("#issued-token")
    token = page.locator("#token-value").inner_text().strip()
    assert token.startswith("syn_c_") and len(token) > 30
    assert "only once" in page.locator("#issued-token").inner_text()
    assert page.locator("table.clients-approved", has_text="acme-lab-9").count() == 1
    shoot(page, "organization-token")
    page.goto(f"{base}{reverse('dashboard:organization', args=['acme'])}")
    assert token not in page.content()
    assert token[:12] in page.content()  # the prefix, to recognize it

    # resolve a conflict, then find the decision in the audit log. While round 3 merges (its
    # merges read round 2's conflict log as they start) deciding waits; once it has failed, round
    # 2's log is still to be read and the decision is taken.
    page.click("nav >> text=Conflicts")
    assert "Berlin" not in page.locator("main").inner_text()
    card = page.locator("article.conflict", has_text="Paris")
    assert "round 3 is merging" in card.inner_text()
    assert card.locator("button", has_text="Accept precaution").count() == 0
    # (the ORM off Playwright's event loop: a thread of its own, with its own connection)
    failed = threading.Thread(
        target=lambda: Round.objects.filter(number=3).update(state=Round.State.FAILED))
    failed.start()
    failed.join()
    page.reload()
    card = page.locator("article.conflict", has_text="Paris")
    assert "Use Weather for will it rain tomorrow in Paris" in card.locator(".composed").inner_text()
    shoot(page, "conflicts")
    card.locator("button", has_text="Accept precaution").click()
    page.wait_for_selector(".messages")
    assert "next round" in page.locator(".messages").inner_text()
    assert "decided: accept" in page.locator("article.conflict", has_text="Paris").inner_text()
    shoot(page, "conflicts-decided")
    page.click("nav >> text=Audit log")
    page.select_option("select[name=action]", "conflict.decide")
    page.click("#audit-filters button[type=submit]")
    page.wait_for_url("**action=conflict.decide**")
    rows = page.locator("#audit tbody tr")
    assert rows.count() == 1
    assert "acme-admin" in rows.first.inner_text() and "accept" in rows.first.inner_text()
    page.goto(f"{base}{reverse('dashboard:audit')}")
    audit_text = page.locator("#audit").inner_text()
    assert "client.approve" in audit_text and "client.enroll" in audit_text
    assert "Globex" not in audit_text
    shoot(page, "audit")

    # privacy: both charts drawn as non-empty plotly SVGs
    page.click("nav >> text=Privacy")
    page.wait_for_selector("#epsilon-per-round[data-rendered=true] svg.main-svg")
    assert page.locator("#epsilon-per-round g.trace.bars path").count() >= 2
    page.wait_for_selector("#epsilon-composed[data-rendered=true] svg.main-svg")
    line = page.locator("#epsilon-composed g.trace.scatter path.js-line").first
    assert len(line.get_attribute("d") or "") > 10
    assert page.locator("#ledger tbody tr").count() == 4  # Acme's rows only
    shoot(page, "privacy")
    page.fill("input[name=epsilon]", "100")
    page.click("form.toolbar button[type=submit]")
    page.wait_for_selector("#budget-warning")
    shoot(page, "privacy-warning")

    # another organization's pages are out of reach
    response = go(page, base, "dashboard:organization", "globex")
    assert response.status == 404
    page.goto(f"{base}{reverse('dashboard:conflicts')}?organization=globex")
    assert page.locator("article.conflict").count() == 0


def test_member_sees_but_cannot_act(review, page, live_server, shoot):
    base = live_server.url
    log_in(page, base, "acme-member")
    go(page, base, "dashboard:organization", "acme")
    assert page.locator("#enroll").count() == 0
    assert page.locator("button", has_text="Revoke").count() == 0
    assert "only its admins" in page.locator("main").inner_text()
    shoot(page, "organization-member")
    go(page, base, "dashboard:conflicts")
    assert page.locator("article.conflict").count() == 1
    assert page.locator("button", has_text="Dismiss").count() == 0
    assert go(page, base, "dashboard:organization", "globex").status == 404


def test_operator_pages(review, page, live_server, shoot):
    base = live_server.url
    log_in(page, base, "operator")
    assert page.locator("#round-controls").is_visible()
    page.wait_for_selector("#participation[data-rendered=true] svg.main-svg")
    shoot(page, "overview-operator")
    asked = []
    page.once("dialog", lambda dialog: (asked.append(dialog.message), dialog.accept()))
    page.locator("#rounds tr", has_text="open").locator("button", has_text="Close").click()
    page.wait_for_selector(".messages")
    assert asked and asked[0].startswith("Close round 4? It takes no more submissions")
    assert "Round 4 closed" in page.locator(".messages").inner_text()
    page.fill("#open-round input[name=epsilon]", "0.5")
    page.fill("#open-round input[name=field_cap]", "3")
    page.select_option("#open-round select[name=robust_rule]", "krum")
    assert "one user can move" in page.locator("#field-cap-help").inner_text()
    shoot(page, "overview-open-round")
    page.click("#open-round button[type=submit]")
    page.wait_for_selector(".messages")
    assert "Round 5 opened (ε = 0.5)" in page.locator(".messages").inner_text()
    assert "field cap F* = 3" in page.locator("#open-round-config").inner_text()

    go(page, base, "dashboard:accuracy")
    for div in ("accuracy-curves", "accuracy-categories", "accuracy-adversarial", "privacy-frontier"):
        page.wait_for_selector(f"#{div}[data-rendered=true] svg.main-svg")
    assert page.locator("#accuracy-curves g.trace.scatter").count() == 4
    shoot(page, "accuracy")

    go(page, base, "dashboard:routing")
    page.fill("input[name=q]", "will it rain in Rome tomorrow?")
    page.click("#route-form button[type=submit]")
    page.wait_for_selector("#candidates")
    assert "weather" in page.locator("#route-decision").inner_text()
    shoot(page, "routing")

    go(page, base, "dashboard:conflicts")
    assert page.locator("article.conflict").count() == 2
    go(page, base, "dashboard:privacy")
    page.wait_for_selector("#epsilon-composed[data-rendered=true] svg.main-svg")
    shoot(page, "privacy-operator")
    go(page, base, "dashboard:organizations")
    assert page.locator("#organizations tbody tr").count() == 2


def test_an_admin_adds_a_person_who_signs_in_and_changes_the_password(review, browser, page, live_server, shoot):
    base = live_server.url
    org_url = f"{base}{reverse('dashboard:organization', args=['acme'])}"
    log_in(page, base, "acme-admin")
    page.goto(org_url)
    page.fill("#add-person input[name=username]", "acme-analyst")
    page.fill("#add-person input[name=email]", "analyst@acme.example")
    page.click("#add-person button[type=submit]")
    page.wait_for_selector("#issued-password")
    password = page.locator("#password-value").inner_text().strip()
    assert len(password) >= 16 and "only once" in page.locator("#issued-password").inner_text()
    shoot(page, "organization-person-added")

    # the new person signs in with it, in a browser of their own, and changes it
    other = browser.new_context(viewport={"width": 1366, "height": 860}).new_page()
    other.goto(f"{base}{reverse('login')}")
    other.fill("#id_username", "acme-analyst")
    other.fill("#id_password", password)
    other.click("button[type=submit]")
    other.wait_for_url(f"{base}/")
    other.click("text=Change password")
    other.fill("#id_old_password", password)
    other.fill("#id_new_password1", "Quiet-Orchard-Lamp-58")
    other.fill("#id_new_password2", "Quiet-Orchard-Lamp-58")
    other.click("main button[type=submit]")
    other.wait_for_selector(".messages")
    assert "Your password was changed." in other.locator(".messages").inner_text()
    other.goto(org_url)
    assert "Reset password" not in other.content()  # a read-only member: no buttons

    # the admin resets it (after confirming): the person's session ends
    page.goto(org_url)
    page.once("dialog", lambda dialog: dialog.accept())
    page.locator("#people tr", has_text="acme-analyst").locator("button", has_text="Reset password").click()
    page.wait_for_selector("#issued-password")
    assert page.locator("#password-value").inner_text().strip() != password
    other.goto(org_url)
    assert other.url.startswith(f"{base}{reverse('login')}")
    other.context.close()


@pytest.fixture
def long_names(federation):
    """A pending client whose name, description and contact are single words of their fields'
    length, as someone may paste them."""
    from federation.models import Client

    return Client.objects.create(
        organization=federation.globex, name="n" * 200, description="d" * 2000,
        contact="c" * 254, status=Client.Status.PENDING,
    )


def test_long_names_wrap_and_leave_the_buttons_in_sight_at_1366px(long_names, page, live_server, shoot):
    """A 200-character client name widened its table to thousands of pixels: the Approve and
    Revoke buttons and the overview's columns ran out of sight."""
    base = live_server.url
    log_in(page, base, "operator")
    go(page, base, "dashboard:organization", "globex")
    width = page.viewport_size["width"]
    assert width == 1366
    row = page.locator("table.clients-pending tr", has_text="n" * 50)
    for label in ("Approve", "Revoke"):
        box = row.locator("button", has_text=label).bounding_box()
        assert box is not None and box["x"] + box["width"] <= width, label
    shoot(page, "organization-long-names")
    go(page, base, "dashboard:overview")
    table = page.locator("table#clients").bounding_box()
    assert table["x"] + table["width"] <= width


def test_back_from_a_refused_form_keeps_what_was_typed(review, page, live_server):
    """A refused form answers a page naming what is wrong, with a Back link. The link loaded the
    form's page again, every field empty: the operator typed the round's twelve settings again.
    It now goes back in the browser's history, to the form as it was left."""
    base = live_server.url
    log_in(page, base, "operator")
    page.once("dialog", lambda dialog: dialog.accept())
    page.locator("#rounds tr", has_text="open").locator("button", has_text="Close").click()
    page.wait_for_selector(".messages")
    page.fill("#open-round input[name=epsilon]", "0.5x")
    page.fill("#open-round input[name=field_cap]", "3")
    page.click("#open-round button[type=submit]")
    page.wait_for_selector("#back")
    assert "epsilon" in page.locator("p.error").inner_text()
    page.click("#back")
    page.wait_for_selector("#open-round")
    assert page.input_value("#open-round input[name=epsilon]") == "0.5x"
    assert page.input_value("#open-round input[name=field_cap]") == "3"


def test_a_refused_confirmation_sends_nothing(review, page, live_server):
    """The revoke button asks first (static/dashboard/confirm.js: no inline script under the
    Content-Security-Policy); dismissing the question leaves the client approved."""
    base = live_server.url
    log_in(page, base, "acme-admin")
    go(page, base, "dashboard:organization", "acme")
    asked = []

    def dismiss(dialog):
        asked.append(dialog.message)
        dialog.dismiss()

    page.once("dialog", dismiss)
    row = page.locator("tr", has_text="acme-node-1")
    row.locator("button", has_text="Revoke").click()
    page.wait_for_timeout(300)
    assert asked == ["Revoke acme-node-1? Its token stops working at once."]
    go(page, base, "dashboard:organization", "acme")
    assert page.locator("tr", has_text="acme-node-1").locator("button", has_text="Revoke").count() == 1


def test_api_docs_and_admin_run_under_the_content_security_policy(review, page, live_server):
    """Swagger UI (served with its initializer as a file) and the Django admin load with the
    policy in force: the page fixture fails the test on any refusal."""
    base = live_server.url
    response = page.goto(f"{base}/api/docs/")
    assert "script-src 'self'" in response.headers["content-security-policy"]
    page.wait_for_selector(".swagger-ui .opblock")
    assert page.locator(".swagger-ui .opblock").count() >= 30
    log_in(page, base, "operator")
    page.goto(f"{base}/admin/")
    page.wait_for_selector("#content")
    page.goto(f"{base}/admin/federation/organization/")
    page.wait_for_selector("#result_list")
    # the browsable API pages, outside the policy (DRF's libraries run an inline event handler)
    response = page.goto(f"{base}/api/v1/rounds/")
    assert "content-security-policy" not in response.headers
    page.wait_for_selector(".response-info")


def test_on_a_phone_the_account_links_stay_on_the_screen(review, page, live_server):
    """On a 390-pixel-wide screen the top bar's account links (API tokens, Change password, Log
    out) did not wrap: they widened the page to about 630 pixels and Log out lay off the screen,
    reachable only by scrolling sideways. They now wrap under the navigation."""
    base = live_server.url
    page.set_viewport_size({"width": 390, "height": 844})
    log_in(page, base, "acme-admin")
    for name in ("dashboard:overview", "dashboard:audit"):
        go(page, base, name)
        for label in ("API tokens", "Change password", "Log out"):
            box = page.locator("header.topbar .account", has_text=label).locator(
                f"text={label}").bounding_box()
            assert box is not None and 0 <= box["x"] and box["x"] + box["width"] <= 390, (name, label, box)
        header = page.evaluate("document.querySelector('header.topbar').scrollWidth")
        assert header <= 390, (name, header)


WIDEST = """() => [...document.querySelectorAll('body *')]
    .filter(e => e.getBoundingClientRect().right > window.innerWidth + 1)
    .filter(e => { for (let a = e.parentElement; a; a = a.parentElement) {
        if (a.tagName !== 'BODY' && a.tagName !== 'HTML'
            && getComputedStyle(a).overflowX !== 'visible') return false; } return true; })
    .slice(0, 8).map(e => e.tagName + '#' + e.id + '.' + e.className + ' '
                          + Math.round(e.getBoundingClientRect().right))"""


def test_on_a_phone_no_page_is_wider_than_the_screen(review, page, live_server):
    """On a 390-pixel-wide screen the overview and an organization's page were 503 and 511
    pixels wide: the page scrolled sideways as a whole (the chart grid's columns were at least
    480 pixels, and a screen-reader label inside a scrolling table escaped its box). Charts now
    take the screen's width and wide tables scroll in their own box."""
    base = live_server.url
    page.set_viewport_size({"width": 390, "height": 844})
    log_in(page, base, "operator")
    for name, *args in (("dashboard:overview",), ("dashboard:organization", "acme"),
                        ("dashboard:organizations",), ("dashboard:privacy",),
                        ("dashboard:audit",), ("dashboard:compendium",), ("dashboard:conflicts",),
                        ("dashboard:accuracy",), ("dashboard:tools",), ("dashboard:routing",)):
        go(page, base, name, *args)
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, (name, width, page.evaluate(WIDEST))


@pytest.fixture
def release_sweep(review):
    """The stored simulation with a k-anonymous release sweep (`simulate --sweep-min-users`)."""
    from federation.models import SimulationRun

    run = SimulationRun.objects.get()
    run.document = {**run.document, "release_sweep": [
        {"min_users": k, "accuracy": 0.61 - 0.01 * k, "membership_auroc": 0.56 - 0.01 * k,
         "token_overlap": 0.31, "bytes_per_client_round": 12345.0}
        for k in (1, 2, 5)
    ]}
    run.save(update_fields=["document"])
    return run


def test_on_a_phone_the_release_sweep_table_scrolls_in_its_own_box(release_sweep, page, live_server):
    """The Accuracy page's k-anonymous release table was a bare table, outside any card: on a
    390-pixel-wide screen it widened the page to about 630 pixels, and at any width it lacked the
    other tables' rules and padding."""
    base = live_server.url
    page.set_viewport_size({"width": 390, "height": 844})
    log_in(page, base, "acme-admin")
    go(page, base, "dashboard:accuracy")
    page.wait_for_selector("#privacy-frontier[data-rendered=true] svg.main-svg")
    assert page.locator("#accuracy-release-table tbody tr").count() == 3
    assert "data" in (page.get_attribute("#accuracy-release-table", "class") or "")
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 390, (width, page.evaluate(WIDEST))


def test_the_slug_field_checks_what_is_typed_before_sending(review, page, live_server):
    """The Create organization form's slug pattern, [-a-zA-Z0-9_]+, is not a valid expression
    under the `v` flag Chromium compiles patterns with: it logged an error and ignored the
    pattern, so a slug with a space went to the server and came back as a refusal page."""
    base = live_server.url
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    log_in(page, base, "operator")
    go(page, base, "dashboard:organizations")
    form = page.locator("#create-organization form")
    form.locator("input[name=name]").fill("Initech")
    form.locator("input[name=slug]").fill("init tech")
    assert form.evaluate("f => f.checkValidity()") is False
    form.locator("input[name=slug]").fill("init-tech_2")
    assert form.evaluate("f => f.checkValidity()") is True
    assert not errors, errors


def test_a_form_sent_after_the_session_ended_returns_to_its_page_after_signing_in(
        review, page, live_server):
    """The session ran out (or the person signed out in another tab) while the organization's
    page was open, and they pressed Approve. The sign-in sent them on to the form's action, a
    POST-only address: a 'Not possible here' page whose Back link led to the sign-in page again,
    now saying 'Your account doesn't have access to that page'. The sign-in now says nothing was
    done and returns to the page the button was on."""
    base = live_server.url
    org = f"{base}{reverse('dashboard:organization', args=['acme'])}"
    log_in(page, base, "acme-admin")
    page.goto(org)
    page.context.clear_cookies(name="sessionid")
    page.locator("table.clients-pending tr", has_text="acme-node-3").locator(
        "button", has_text="Approve").click()
    page.wait_for_selector("#id_username")
    assert "nothing was done" in page.locator(".messages").inner_text()
    page.fill("#id_username", "acme-admin")
    page.fill("#id_password", PASSWORD)
    page.click("main button[type=submit]")
    page.wait_for_url(org)
    row = page.locator("table.clients-pending tr", has_text="acme-node-3")
    row.locator("button", has_text="Approve").click()
    page.wait_for_selector("#issued-token")


def test_back_from_a_refusal_after_a_token_was_shown_returns_to_the_organization(
        review, page, live_server):
    """Approve answers the organization's page with the token, at the approve action's address,
    a POST's answer kept from the cache (no-store). A refused form sent from it (a taken client
    name) led Back to that history entry: Chromium's 'Confirm Form Resubmission' error page
    (ERR_CACHE_MISS), and a reload sent the approval again (a 409). The page now takes the
    organization page's own address: Back and reload load it, without the token."""
    base = live_server.url
    org = f"{base}{reverse('dashboard:organization', args=['acme'])}"
    log_in(page, base, "acme-admin")
    page.goto(org)
    page.locator("table.clients-pending tr", has_text="acme-node-3").locator(
        "button", has_text="Approve").click()
    page.wait_for_selector("#issued-token")
    assert page.url == org
    page.fill("#enroll input[name=name]", "acme-node-1")  # taken
    page.click("#enroll button[type=submit]")
    page.wait_for_selector("#back")
    page.click("#back")
    page.wait_for_url(org)
    page.wait_for_selector("#enroll")
    assert page.locator("#issued-token").count() == 0
    # a reload of a page that showed a token loads the page, not the rotation again
    page.goto(org)
    row = page.locator("table.clients-approved tr", has_text="acme-node-3")
    page.once("dialog", lambda dialog: dialog.accept())
    row.locator("button", has_text="Rotate token").click()
    page.wait_for_selector("#issued-token")
    response = page.reload()
    assert response.status == 200 and page.url == org
    assert page.locator("#issued-token").count() == 0


@pytest.fixture
def routing_calls(federation):
    """Four single-query routing API calls over the last hours: at most two in one hour."""
    import datetime as dt

    from django.utils import timezone

    from routing.models import RoutingCall

    now = timezone.now()
    RoutingCall.objects.bulk_create([
        RoutingCall(at=now - dt.timedelta(hours=hours, minutes=1), latency_ms=10.0 + hours,
                    reranker="fusion")
        for hours in (1, 2, 2, 5)
    ])


def test_the_routing_traffic_chart_counts_calls_in_whole_numbers(routing_calls, page, live_server):
    """The routing playground's traffic chart drew its calls-per-hour axis with plotly's
    automatic ticks: 0, 0.5, 1, 1.5, 2 for at most two calls in an hour, half a call."""
    base = live_server.url
    log_in(page, base, "operator")
    go(page, base, "dashboard:routing")
    page.wait_for_selector("#routing-latency[data-rendered=true] svg.main-svg")
    ticks = page.locator("#routing-latency g.y2tick text").all_text_contents()
    assert ticks and all(t.isdigit() for t in ticks), ticks
    assert "2" in ticks


def test_checking_an_epsilon_keeps_the_ledger_filter(review, page, live_server):
    """The Privacy page's ledger filter kept the ε being checked, but the Check form dropped the
    ledger's round and tool: checking a round's ε showed the whole ledger again."""
    base = live_server.url
    log_in(page, base, "acme-admin")
    go(page, base, "dashboard:privacy")
    page.fill("#ledger-filter input[name=round]", "1")
    page.fill("#ledger-filter input[name=tool]", "weather")
    page.click("#ledger-filter button[type=submit]")
    page.wait_for_url("**round=1**")
    assert page.locator("#ledger tbody tr").count() == 2
    page.fill("#epsilon-check input[name=epsilon]", "2")
    page.click("#epsilon-check button[type=submit]")
    page.wait_for_url("**epsilon=2**")
    assert page.locator("#budget-ok").count() == 1
    assert page.locator("#ledger tbody tr").count() == 2
    assert page.input_value("#ledger-filter input[name=round]") == "1"
    assert page.input_value("#ledger-filter input[name=tool]") == "weather"


OUT_OF_CARD = """() => [...document.querySelectorAll('.card input, .card select, .card button')]
    .filter(e => e.getBoundingClientRect().right > e.closest('.card').getBoundingClientRect().right + 1)
    .map(e => e.name + ' ' + Math.round(e.getBoundingClientRect().right))"""


def test_on_a_phone_the_round_deadline_inputs_stay_in_their_card(review, page, live_server):
    """On a 390-pixel-wide screen the round controls' date-and-time inputs (the open round's
    deadline, and the Open round form's closes at) did not shrink with their label: they ran past
    the card's edge to the screen's, the picker's button on the border."""
    base = live_server.url
    page.set_viewport_size({"width": 390, "height": 844})
    log_in(page, base, "operator")
    page.wait_for_selector("#round-deadline")
    assert page.evaluate(OUT_OF_CARD) == []
    page.once("dialog", lambda dialog: dialog.accept())
    page.locator("#rounds tr", has_text="open").locator("button", has_text="Close").click()
    page.wait_for_selector("#open-round")
    assert page.evaluate(OUT_OF_CARD) == []


LEGEND_OVER_AXIS = """(id) => {
    const chart = document.getElementById(id);
    const boxes = s => [...chart.querySelectorAll(s)].map(e => e.getBoundingClientRect())
        .filter(r => r.width > 0);
    const labels = [...boxes('g.xtick text'), ...boxes('text.xtitle')];
    return boxes('g.legend g.traces').some(l => labels.some(t =>
        l.left < t.right && t.left < l.right && l.top < t.bottom && t.top < l.bottom));
}"""


def test_chart_legends_stay_clear_of_the_x_axis_on_a_phone_and_after_widening(
        review, page, live_server):
    """The legends sat at a fraction of the plot's height below it. On a phone the privacy
    page's six-entry legend covered the x axis title; and a window narrowed and widened again
    (a tablet turned) left the accuracy charts' legends over their round ticks and axis title.
    They are now anchored to the chart's bottom edge, the plot making room above them."""
    base = live_server.url
    log_in(page, base, "operator")
    page.set_viewport_size({"width": 390, "height": 844})
    go(page, base, "dashboard:privacy")
    page.wait_for_selector("#epsilon-composed[data-rendered=true] svg.main-svg")
    assert not page.evaluate(LEGEND_OVER_AXIS, "epsilon-composed")
    page.set_viewport_size({"width": 1366, "height": 860})
    go(page, base, "dashboard:accuracy")
    for chart in ("accuracy-curves", "accuracy-adversarial"):
        page.wait_for_selector(f"#{chart}[data-rendered=true] svg.main-svg")
    page.set_viewport_size({"width": 390, "height": 844})
    page.wait_for_timeout(800)  # plotly redraws on the window's resize
    page.set_viewport_size({"width": 1366, "height": 860})
    page.wait_for_timeout(800)
    for chart in ("accuracy-curves", "accuracy-adversarial"):
        assert not page.evaluate(LEGEND_OVER_AXIS, chart), chart
