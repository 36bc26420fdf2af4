"""The same facts on every surface that shows them, for every role that may see them.

A federation of two organizations with four rounds: round 1 published, round 2 published under a
field cap with an erased client's re-release at one edge, round 3 failed after one edge released,
round 4 open (a reservation, no ledger rows). Its privacy figures are read from the Privacy page
(context and HTML), `manage.py privacy_report`, the settings API and /metrics; its round states
and submission counts from the Overview, `manage.py round_status`, the rounds API and /metrics.
The expected figures are computed here by hand from the ledger rows, as README's "Privacy
accounting" defines them, so a surface that drifts from the others fails against them.
"""

from __future__ import annotations

import html
import io
import json
import math
import re

import pytest
from django.core.management import call_command
from django.urls import reverse

from compendium.schema import Compendium, Scenario
from compendium.services import store_compendium
from federation import services
from federation.models import AuditLog, PrivacyLedgerEntry, Round, Submission
from tests.federation_fixtures import SYSTEM, client_api

pytestmark = pytest.mark.django_db

DELTA = 1e-5
BUDGET = 7.5
ROLES = ["operator", "admin_a", "member_a", "admin_b"]


def _ledger(rnd, org, rows, *, release=0, field_cap=None, k=4):
    for tool, field, eps in rows:
        PrivacyLedgerEntry.objects.create(
            round=rnd, organization=org, release=release, tool_id=tool, field=field,
            sensitivity=1.0, contributors=k, epsilon=eps, noise_scale=1.0 / (k * eps),
            field_cap=field_cap,
        )


def _submit(client, rnd, key, text="asks for rain"):
    version = store_compendium(
        Compendium(scenarios=[Scenario(tool_id="weather", text=f"{client.name} {text}")]),
        kind="client", round=rnd, client=client,
    )
    Submission.objects.create(client=client, round=rnd, idempotency_key=key,
                              request_sha256="0" * 64, response={}, wire_bytes=100,
                              version=version)
    return version


def _advanced(eps: list[float]) -> float:
    r, e = len(eps), max(eps)
    return math.sqrt(2 * r * math.log(1 / DELTA)) * e + r * e * (math.exp(e) - 1)


# Per organization and round, what one user can lose (README "Privacy accounting"): Σ ε_j, under a
# field cap the 2·F* largest per-tool sums, summed over re-materializations.
SPEND = {
    "org-a": {1: 1 / 3 * 3, 2: 1.0 + 1.0, 3: 0.5},  # round 2: calculator's 0.6 is not among the top 2
    "org-b": {1: 0.75, 2: 1.6 + 0.6},  # round 2: release 0 and the erased client's release 1
}
FEDERATION = {1: max(SPEND["org-a"][1], SPEND["org-b"][1]),
              2: max(SPEND["org-a"][2], SPEND["org-b"][2]), 3: SPEND["org-a"][3]}
RESERVED = {4: 1.5}  # the open round's ε: no ledger rows yet


@pytest.fixture
def fed(world, every_field_released):
    services.update_settings(SYSTEM, epsilon_budget=BUDGET)
    a, b = world.org_a, world.org_b
    # round 4 stored first: no round's id is its number, so a surface naming rounds by id fails
    r4 = Round.objects.create(number=4, state=Round.State.OPEN, config={"epsilon": 1.5})
    r1 = Round.objects.create(number=1, state=Round.State.PUBLISHED, config={"epsilon": 1.0})
    r2 = Round.objects.create(number=2, state=Round.State.PUBLISHED,
                              config={"epsilon": 2.0, "field_cap": 1})
    r3 = Round.objects.create(number=3, state=Round.State.FAILED, config={"epsilon": 1.0},
                              failure_reason="merge of org-b failed")
    assert all(r.pk != r.number for r in (r1, r2, r3, r4))
    third = 1 / 3
    _ledger(r1, a, [("weather", "calls", third), ("weather", "success_rate", third),
                    ("flights", "calls", third)])
    _ledger(r1, b, [("weather", "calls", 0.25), ("flights", "calls", 0.25),
                    ("calculator", "calls", 0.25)])
    _ledger(r2, a, [("weather", "calls", 0.5), ("weather", "success_rate", 0.5),
                    ("flights", "calls", 0.5), ("flights", "success_rate", 0.5),
                    ("calculator", "calls", 0.3), ("calculator", "success_rate", 0.3)], field_cap=1)
    _ledger(r2, b, [("weather", "calls", 0.4), ("weather", "success_rate", 0.4),
                    ("flights", "calls", 0.4), ("flights", "success_rate", 0.4)], field_cap=1)
    _ledger(r2, b, [("weather", "calls", 0.3), ("weather", "success_rate", 0.3)], release=1,
            field_cap=1, k=3)
    _ledger(r3, a, [("weather", "calls", 0.5)])
    # submissions: both clients in rounds 1-2 (client a1 replaced its round-2 submission), a1 in
    # the failed round 3, b1 in the open round 4
    _submit(world.client_a, r1, "a-1")
    _submit(world.client_b, r1, "b-1")
    Submission.objects.create(client=world.client_a, round=r2, idempotency_key="a-2-replaced",
                              request_sha256="0" * 64, response={}, wire_bytes=90)
    _submit(world.client_a, r2, "a-2")
    _submit(world.client_b, r2, "b-2")
    _submit(world.client_a, r3, "a-3")
    _submit(world.client_b, r4, "b-4")
    return world


def _expected(spends: list[float]) -> dict:
    return {"basic": sum(spends), "advanced": _advanced(spends), "rounds": len(spends)}


def _check_composition(got: dict, spends: list[float]):
    want = _expected(spends)
    assert got["rounds"] == want["rounds"]
    assert got["basic_epsilon"] == pytest.approx(want["basic"])
    assert got["advanced_epsilon"] == pytest.approx(want["advanced"])
    assert got["epsilon"] == pytest.approx(min(want["basic"], want["advanced"]))


def _fed_spends():
    return [FEDERATION[r] for r in sorted(FEDERATION)]


def _org_spends(slug):
    return [SPEND[slug][r] for r in sorted(SPEND[slug])]


def _metrics(response) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    assert response.status_code == 200, response.content
    out = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _committed_shown(body: str) -> str:
    """The Privacy page's committed ε′, which must be named the advanced bound here."""
    return re.search(r'([\d.]+)</span><span class="label">federation ε′ committed \(advanced\)',
                     body).group(1)


def _agrees(text: str, value: float) -> bool:
    """Whether a figure as a page shows it is `value` rounded to the digits it shows (7.9999
    shown as 8.000 or 8.00 agrees; 7.99 does not)."""
    digits = len(text.split(".")[1]) if "." in text else 0
    return abs(float(text) - value) <= 0.5 * 10 ** -digits + 1e-12


# --- privacy -------------------------------------------------------------------------------------


def test_privacy_report_has_the_ledgers_figures(fed):
    out = io.StringIO()
    call_command("privacy_report", stdout=out)
    report = json.loads(out.getvalue())
    assert report["epsilon_budget"] == BUDGET
    _check_composition(report["federation"], _fed_spends())
    _check_composition(report["committed"], _fed_spends() + [RESERVED[4]])
    assert report["reserved_by_round"] == {"4": pytest.approx(RESERVED[4])}
    assert set(report["organizations"]) == {"org-a", "org-b"}
    for slug in ("org-a", "org-b"):
        _check_composition(report["organizations"][slug], _org_spends(slug))


def test_metrics_agree_with_the_privacy_report(client, fed):
    client.force_login(fed.operator)
    m = _metrics(client.get("/metrics"))
    assert m[("synapse_privacy_epsilon_budget", ())] == BUDGET
    assert m[("synapse_privacy_epsilon_spent", ())] == pytest.approx(sum(_fed_spends()))
    assert m[("synapse_privacy_epsilon_committed", ())] == pytest.approx(
        sum(_fed_spends()) + RESERVED[4])
    for slug in ("org-a", "org-b"):
        assert m[("synapse_privacy_organization_epsilon_spent", (("organization", slug),))] == (
            pytest.approx(sum(_org_spends(slug))))


@pytest.mark.parametrize("role", ROLES)
def test_privacy_page_agrees_for_every_role(client, fed, role):
    client.force_login(getattr(fed, role))
    response = client.get(reverse("dashboard:privacy"))
    assert response.status_code == 200
    privacy = response.context["privacy"]
    body = html.unescape(response.content.decode())
    # federation-wide: every member
    assert privacy.budget == BUDGET
    fed_spends = _fed_spends()
    assert privacy.federation.basic_epsilon == pytest.approx(sum(fed_spends))
    assert privacy.federation.advanced_epsilon == pytest.approx(_advanced(fed_spends))
    assert privacy.federation.rounds == 3
    committed = sum(fed_spends) + RESERVED[4]
    assert privacy.committed.epsilon == pytest.approx(committed)
    assert privacy.reserved == [(4, pytest.approx(RESERVED[4]))]
    # the next round at the last round's ε (1.5) on top of the committed figure
    assert privacy.projected.epsilon == pytest.approx(committed + 1.5)
    figures = re.findall(r'<span class="value">([^<]*)</span><span class="label">([^<]*)', body)
    shown = {label.split(":")[0].split(" (")[0]: value for value, label in figures}
    assert _agrees(shown["budget cap ε"], BUDGET)
    assert _agrees(shown["federation ε′ committed"], committed)
    assert _agrees(shown["federation ε′ basic, recorded in the ledger"], sum(fed_spends))
    assert _agrees(shown["federation ε′ advanced, recorded in the ledger"], _advanced(fed_spends))
    assert shown["rounds with releases"] == "3"
    assert _agrees(shown["ε reserved by rounds not released yet"], RESERVED[4])
    assert f"round 4: {RESERVED[4]:g}" in body
    # per organization: the operator every one, a member only their own
    visible = {"operator": ["Org A", "Org B"], "admin_a": ["Org A"], "member_a": ["Org A"],
               "admin_b": ["Org B"]}[role]
    assert [name for name, _ in privacy.organizations] == visible
    table = body[body.index('id="privacy-organizations"'):body.index("</table>",
                                                                     body.index('id="privacy-organizations"'))]
    rows = re.findall(r"<tr><td>([^<]*)</td><td class=\"num\">(\d+)</td><td class=\"num\">([^<]*)</td>"
                      r"<td class=\"num\">([^<]*)</td><td class=\"num\">([^ ]*) \((\w+)\)</td>"
                      r"<td class=\"num\">(\d+) %</td></tr>", table)
    assert [r[0] for r in rows] == visible
    for name, rounds, basic, advanced, reported, tighter, percent in rows:
        spends = _org_spends({"Org A": "org-a", "Org B": "org-b"}[name])
        assert int(rounds) == len(spends)
        assert _agrees(basic, sum(spends)) and _agrees(reported, sum(spends))
        assert _agrees(advanced, _advanced(spends)) and tighter == "basic"
        assert int(percent) == round(100 * sum(spends) / BUDGET)
    # the charts: ε per round and the composed curve end at the table's figures
    charts = [json.loads(html.unescape(raw))
              for raw in re.findall(r'data-plotly="([^"]*)"', response.content.decode())]
    per_round = {t["name"]: dict(zip(t["x"], t["y"], strict=True)) for t in charts[0]["data"]}
    assert per_round["federation"] == {r: pytest.approx(e) for r, e in FEDERATION.items()}
    slugs = {"Org A": "org-a", "Org B": "org-b"}
    assert set(per_round) == {"federation", *visible}
    for name in visible:
        assert per_round[name] == {r: pytest.approx(e) for r, e in SPEND[slugs[name]].items()}
    curves = {t["name"]: t["y"][-1] for t in charts[1]["data"]}
    assert curves["federation: basic"] == pytest.approx(sum(fed_spends))
    for name in visible:
        assert curves[f"{name}: basic"] == pytest.approx(sum(_org_spends(slugs[name])))


@pytest.mark.parametrize("role", ROLES)
def test_settings_api_and_overview_give_the_same_cap_and_committed_figure(client, fed, role):
    user = getattr(fed, role)
    client.force_login(user)
    assert client.get("/api/v1/admin/settings/").json()["epsilon_budget"] == BUDGET
    if role == "operator":  # the round controls are the operator's
        body = html.unescape(client.get(reverse("dashboard:overview")).content.decode())
        line = re.search(r'id="round-budget">([^<]*)', body).group(1)
        committed = sum(_fed_spends()) + RESERVED[4]
        figures = re.search(r"committed ε′ is ([\d.]+) of the cap ([\d.]+) \((\d+) %\); one more "
                            r"round at ε = ([\d.]+) would bring it to ([\d.]+)", line)
        assert figures, line
        now, cap, percent, eps, after = figures.groups()
        assert _agrees(now, committed) and _agrees(cap, BUDGET)
        assert _agrees(percent, 100 * committed / BUDGET)
        assert _agrees(eps, 1.5) and _agrees(after, committed + 1.5)


# --- rounds and submissions ----------------------------------------------------------------------

# (state, clients with a submission) per round, per organization
ROUNDS = {1: ("published", {"org-a": 1, "org-b": 1}), 2: ("published", {"org-a": 1, "org-b": 1}),
          3: ("failed", {"org-a": 1, "org-b": 0}), 4: ("open", {"org-a": 0, "org-b": 1})}
SCOPE = {"operator": ("org-a", "org-b"), "admin_a": ("org-a",), "member_a": ("org-a",),
         "admin_b": ("org-b",)}


def _count(number, slugs):
    return sum(ROUNDS[number][1][s] for s in slugs)


def test_round_status_and_metrics_count_the_same_submissions(client, fed):
    out = io.StringIO()
    call_command("round_status", stdout=out)
    lines = {int(m.group(1)): (m.group(2), int(m.group(3)))
             for m in re.finditer(r"round (\d+): (\w+) \(.*?submissions from (\d+) client",
                                  out.getvalue())}
    assert lines == {n: (state, _count(n, ("org-a", "org-b"))) for n, (state, _) in ROUNDS.items()}
    client.force_login(fed.operator)
    m = _metrics(client.get("/metrics"))
    for state in Round.State.values:
        assert m[("synapse_rounds", (("state", state),))] == sum(
            s == state for s, _ in ROUNDS.values())
    assert m[("synapse_open_round", ())] == 4
    assert m[("synapse_open_round_submitting_clients", ())] == _count(4, ("org-a", "org-b"))
    for slug in ("org-a", "org-b"):  # submission records kept: a1's replaced one included
        kept = sum(ROUNDS[n][1][slug] for n in ROUNDS) + (slug == "org-a")
        assert m[("synapse_submissions", (("organization", slug),))] == kept
    # ... one more than the Overview's "client submissions" (the compendiums in effect): the
    # metric's help says so, or a scrape and the page read as disagreeing on one fact
    totals = client.get(reverse("dashboard:overview")).context["overview"].totals
    assert totals["submissions"] == sum(c for _, counts in ROUNDS.values() for c in counts.values())
    assert sum(m[("synapse_submissions", (("organization", s),))] for s in ("org-a", "org-b")) == (
        totals["submissions"] + 1)
    from prometheus_client.parser import text_string_to_metric_families

    help_text = next(f.documentation for f in text_string_to_metric_families(
        client.get("/metrics").content.decode()) if f.name == "synapse_submissions")
    assert "replaced included" in help_text and "Overview" in help_text


@pytest.mark.parametrize("role", ROLES)
def test_overview_and_rounds_api_count_the_same_submissions_for_every_role(client, fed, role):
    client.force_login(getattr(fed, role))
    overview = client.get(reverse("dashboard:overview")).context["overview"]
    shown = {row.round.number: (row.round.state, row.submissions) for row in overview.rounds}
    # rounds by state are federation-wide, as on /metrics (synapse_rounds)
    assert overview.state_counts == {"published": 2, "failed": 1, "open": 1}
    want = {n: (state, _count(n, SCOPE[role])) for n, (state, _) in ROUNDS.items()}
    assert shown == want
    api = {r["number"]: (r["state"], r["submissions"])
           for r in client.get("/api/v1/rounds/").json()["results"]}
    assert api == want


@pytest.mark.parametrize("who", ["client_a", "client_b"])
def test_a_clients_rounds_api_counts_its_own_organization(fed, who):
    token = fed.token_a if who == "client_a" else fed.token_b
    api = {r["number"]: (r["state"], r["submissions"])
           for r in client_api(token).get("/api/v1/rounds/").json()["results"]}
    slug = "org-a" if who == "client_a" else "org-b"
    assert api == {n: (state, _count(n, (slug,))) for n, (state, _) in ROUNDS.items()}


# --- a client's status -------------------------------------------------------------------------


def test_a_revoked_clients_status_is_the_same_on_the_org_page_the_api_and_the_audit_log(client, fed):
    services.revoke_client(fed.actor(fed.admin_a), fed.client_a, reason="laptop lost")
    for role in ("operator", "admin_a", "member_a"):
        client.force_login(getattr(fed, role))
        page = client.get(reverse("dashboard:organization", args=["org-a"]))
        body = html.unescape(page.content.decode())
        row = re.search(r"<tr[^>]*>(?:(?!</tr>).)*?\ba1\b(?:(?!</tr>).)*</tr>", body, re.S).group(0)
        assert "revoked" in row and "approved" not in row
        api = client.get(f"/api/v1/admin/clients/{fed.client_a.pk}/")
        assert api.status_code == 200 and api.json()["status"] == "revoked"
    entry = AuditLog.objects.filter(action=AuditLog.Action.CLIENT_REVOKE).get()
    assert entry.target_id == str(fed.client_a.pk) and entry.organization_id == fed.org_a.pk
    # clients by status: the organization page, the clients API and /metrics
    client.force_login(fed.operator)
    m = _metrics(client.get("/metrics"))
    api = client.get("/api/v1/admin/clients/", {"limit": 100}).json()["results"]
    for slug in ("org-a", "org-b"):
        org = client.get(reverse("dashboard:organization", args=[slug])).context["org"]
        for status in ("pending", "approved", "revoked"):
            on_page = len(org.clients[status])
            assert on_page == m[("synapse_clients", (("organization", slug), ("status", status)))]
            assert on_page == sum(c["organization"] == slug and c["status"] == status for c in api)
    assert m[("synapse_clients", (("organization", "org-a"), ("status", "revoked")))] == 1


# --- advanced composition the tighter ------------------------------------------------------------


def test_every_surface_reports_the_advanced_bound_where_it_is_the_tighter(client, world):
    """40 rounds at ε = 0.05 for one organization: advanced composition (1.62) is tighter than
    basic (2.0), and every surface reports it, named so."""
    rounds = [Round.objects.create(number=n, state=Round.State.PUBLISHED, config={"epsilon": 0.05})
              for n in range(1, 41)]
    for rnd in rounds:
        _ledger(rnd, world.org_a, [("weather", "calls", 0.05)])
    spends = [0.05] * 40
    advanced = _advanced(spends)
    assert advanced < sum(spends)
    out = io.StringIO()
    call_command("privacy_report", stdout=out)
    report = json.loads(out.getvalue())
    for key in ("federation", "committed"):
        assert report[key]["tighter"] == "advanced" and report[key]["delta"] == DELTA
        assert report[key]["epsilon"] == pytest.approx(advanced)
    assert report["organizations"]["org-a"]["epsilon"] == pytest.approx(advanced)
    client.force_login(world.operator)
    m = _metrics(client.get("/metrics"))
    assert m[("synapse_privacy_epsilon_spent", ())] == pytest.approx(advanced)
    assert m[("synapse_privacy_epsilon_committed", ())] == pytest.approx(advanced)
    assert m[("synapse_privacy_organization_epsilon_spent", (("organization", "org-a"),))] == (
        pytest.approx(advanced))
    for role in ("operator", "admin_a"):
        client.force_login(getattr(world, role))
        body = html.unescape(client.get(reverse("dashboard:privacy")).content.decode())
        assert _agrees(_committed_shown(body), advanced)
        assert _agrees(re.search(r'<td class="num">([\d.]+) \(advanced\)</td>', body).group(1), advanced)
    client.force_login(world.admin_b)  # no release of its own: no row, the federation's figure
    body = html.unescape(client.get(reverse("dashboard:privacy")).content.decode())
    assert _agrees(_committed_shown(body), advanced)
    assert 'id="privacy-organizations"' not in body


def test_the_settings_refuse_a_cap_below_the_committed_figure_the_pages_show(client, fed):
    committed = sum(_fed_spends()) + RESERVED[4]
    client.force_login(fed.operator)
    refused = client.patch("/api/v1/admin/settings/", {"epsilon_budget": committed - 0.01},
                           content_type="application/json")
    assert refused.status_code == 409 and f"committed ({committed:.6g}" in refused.content.decode()
    accepted = client.patch("/api/v1/admin/settings/", {"epsilon_budget": committed},
                            content_type="application/json")
    assert accepted.status_code == 200 and accepted.json()["epsilon_budget"] == committed


@pytest.mark.parametrize("role,slug", [("operator", "org-a"), ("operator", "org-b"),
                                       ("admin_a", "org-a"), ("member_a", "org-a"),
                                       ("admin_b", "org-b")])
def test_the_organization_page_counts_the_overviews_submissions(client, fed, role, slug):
    client.force_login(getattr(fed, role))
    org = client.get(reverse("dashboard:organization", args=[slug])).context["org"]
    shown = {row["round"]: row["submissions"] for row in org.edge_rows}
    # a round without a submission or an edge of the organization has no row
    assert shown == {n: c[slug] for n, (_, c) in ROUNDS.items() if c[slug]}


# --- a real round, an erasure's re-release and an open round's reservation -----------------------


def _ledger_spends() -> dict[str, dict[int, float]]:
    """{organization slug: {round number: ε}} read from the ledger rows by hand: per release Σ ε_j,
    or under a field cap the 2·F* largest per-tool sums; releases summed."""
    from collections import defaultdict

    per_release: dict = defaultdict(lambda: defaultdict(float))
    caps = {}
    for row in PrivacyLedgerEntry.objects.select_related("round", "organization"):
        key = (row.organization.slug, row.round.number, row.release)
        per_release[key][row.tool_id] += row.epsilon
        caps[key] = row.field_cap
    out: dict = defaultdict(lambda: defaultdict(float))
    for (slug, number, release), tools in per_release.items():
        sums = sorted(tools.values(), reverse=True)
        out[slug][number] += sum(sums if caps[(slug, number, release)] is None
                                 else sums[: 2 * caps[(slug, number, release)]])
    return out


@pytest.mark.usefixtures("every_field_released")
def test_a_real_round_with_an_erasure_and_an_open_round_reads_the_same_everywhere(
    client, probes, django_capture_on_commit_callbacks
):
    from federation.models import Membership
    from tests.federation_fixtures import make_user
    from tests.merge_helpers import RELEASING_CONFIG, build_federation
    from tests.merge_helpers import close_round as close

    services.update_settings(SYSTEM, epsilon_budget=20.0)
    round_, clients = build_federation(config=RELEASING_CONFIG)
    from compendium.models import CompendiumVersion

    for version in CompendiumVersion.objects.filter(kind="client", round=round_):
        # each stored with its submission record, as `submissions.submit` stores them
        Submission.objects.create(client=version.client, round=round_,
                                  idempotency_key=f"k-{version.pk}", request_sha256="0" * 64,
                                  response={}, wire_bytes=100, version=version)
    close(round_, django_capture_on_commit_callbacks)
    assert round_.state == Round.State.PUBLISHED
    call_command("erase_client", "acme/a2", stdout=io.StringIO())
    operator = make_user("op", superuser=True)
    acme_admin = make_user("acme_admin", clients[("acme", "a1")].organization, Membership.Role.ADMIN)
    globex_admin = make_user("globex_admin", clients[("globex", "g1")].organization,
                             Membership.Role.ADMIN)
    services.open_round(services.Actor.for_user(operator), RELEASING_CONFIG)

    spends = _ledger_spends()
    assert set(PrivacyLedgerEntry.objects.filter(organization__slug="acme")
               .values_list("release", flat=True)) == {0, 1}  # the erasure's re-release
    assert set(spends) == {"acme", "globex"} and spends["acme"][1] > spends["globex"][1] > 0
    recorded = max(spends["acme"][1], spends["globex"][1])
    reserved = RELEASING_CONFIG["epsilon"]  # round 2: every field released, its whole ε

    out = io.StringIO()
    call_command("privacy_report", stdout=out)
    report = json.loads(out.getvalue())
    assert report["federation"]["basic_epsilon"] == pytest.approx(recorded)
    assert report["committed"]["basic_epsilon"] == pytest.approx(recorded + reserved)
    assert report["reserved_by_round"] == {"2": pytest.approx(reserved)}
    for slug in ("acme", "globex"):
        assert report["organizations"][slug]["basic_epsilon"] == pytest.approx(spends[slug][1])

    client.force_login(operator)
    m = _metrics(client.get("/metrics"))
    assert m[("synapse_privacy_epsilon_spent", ())] == pytest.approx(recorded)
    assert m[("synapse_privacy_epsilon_committed", ())] == pytest.approx(recorded + reserved)
    for slug in ("acme", "globex"):
        assert m[("synapse_privacy_organization_epsilon_spent", (("organization", slug),))] == (
            pytest.approx(spends[slug][1]))
    assert m[("synapse_open_round", ())] == 2 and m[("synapse_open_round_submitting_clients", ())] == 0

    for user, visible in ((operator, ["acme", "globex"]), (acme_admin, ["acme"]),
                          (globex_admin, ["globex"])):
        client.force_login(user)
        privacy = client.get(reverse("dashboard:privacy")).context["privacy"]
        assert privacy.federation.basic_epsilon == pytest.approx(recorded)
        assert privacy.committed.basic_epsilon == pytest.approx(recorded + reserved)
        assert privacy.reserved == [(2, pytest.approx(reserved))]
        assert [(name, c.basic_epsilon) for name, c in privacy.organizations] == [
            (slug, pytest.approx(spends[slug][1])) for slug in visible]
        # round 1 after the erasure: a1 at acme, g1 at globex; round 2 open, nothing yet
        want = {1: ("published", sum(1 for s in visible)), 2: ("open", 0)}
        overview = client.get(reverse("dashboard:overview")).context["overview"]
        assert {r.round.number: (r.round.state, r.submissions) for r in overview.rounds} == want
        api = client.get("/api/v1/rounds/").json()["results"]
        assert {r["number"]: (r["state"], r["submissions"]) for r in api} == want
    out = io.StringIO()
    call_command("round_status", stdout=out)
    assert "round 2: open" in out.getvalue() and "submissions from 0 clients" in out.getvalue()
    assert re.search(r"round 1: published .*submissions from 2 clients", out.getvalue())


def test_the_privacy_page_names_the_bound_the_cap_is_checked_against(client, world):
    """25 rounds at ε = 0.05 in the ledger, where basic (1.25) is still the tighter, and an open
    26th reserving 0.05, with which advanced composition becomes the tighter of the committed ε′:
    the cap is checked against that advanced figure, and the page must not say it is basic."""
    for n in range(1, 26):
        rnd = Round.objects.create(number=n, state=Round.State.PUBLISHED, config={"epsilon": 0.05})
        _ledger(rnd, world.org_a, [("weather", "calls", 0.05)])
    Round.objects.create(number=26, state=Round.State.OPEN, config={"epsilon": 0.05})
    assert _advanced([0.05] * 25) > 25 * 0.05 and _advanced([0.05] * 26) < 26 * 0.05
    client.force_login(world.operator)
    privacy = client.get(reverse("dashboard:privacy")).context["privacy"]
    assert privacy.federation.tighter == "basic" and privacy.committed.tighter == "advanced"
    body = html.unescape(client.get(reverse("dashboard:privacy")).content.decode())
    assert "federation ε′ committed (advanced)" in body
    assert "the cap is checked against basic" not in body
    assert "the cap is checked against the committed ε′ (advanced)" in body


def test_the_privacy_pages_projection_is_what_opening_the_round_commits(client, fed):
    """While round 4 is open, the page says an ε fits the budget but not that a round would be
    accepted (the API refuses a second open round); with no round open, opening one at that ε
    commits exactly the ε′ the page projected."""
    client.force_login(fed.operator)
    body = html.unescape(client.get(reverse("dashboard:privacy"), {"epsilon": "1"}).content.decode())
    assert "A round at ε = 1.0 would be within the budget" in body
    assert "Round 4 is open: the next round can be opened once it has closed" in body
    assert client.post("/api/v1/admin/rounds/", {"epsilon": 1}, content_type="application/json"
                       ).status_code == 409
    Round.objects.filter(number=4).update(state=Round.State.FAILED)  # no open round, no reservation
    response = client.get(reverse("dashboard:privacy"), {"epsilon": "1"})
    projected = response.context["privacy"].projected.epsilon
    body = html.unescape(response.content.decode())
    assert "would be within the budget" in body and "is open" not in body
    assert projected == pytest.approx(sum(_fed_spends()) + 1.0)
    opened = client.post("/api/v1/admin/rounds/", {"epsilon": 1}, content_type="application/json")
    assert opened.status_code == 201, opened.content
    out = io.StringIO()
    call_command("privacy_report", stdout=out)
    assert json.loads(out.getvalue())["committed"]["epsilon"] == pytest.approx(projected)
