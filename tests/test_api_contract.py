"""The API answers as its OpenAPI document says (/api/schema/, what /api/docs/ shows and what a
client's generated code relies on): schemathesis draws requests from the document, valid ones and
ones that break it (wrong types, missing fields, out-of-range numbers, unknown enum values), sends
them to the application in-process, against a small federation in the test database (published
rounds with global compendiums and the router's embeddings, a merging and an open round, people of
every role, conflicts, ledger rows), as the operator, an organization admin, a read-only member
and a client, and checks each answer: never a 5xx, a status the
document lists for the operation, a body of the documented shape (an error's `detail`, a person's
`last_login` that may be null, ...)."""

from __future__ import annotations

import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from federation import services
from tests.dashboard_data import add_review_data, build_federation
from tests.federation_fixtures import SYSTEM

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
EXAMPLES = 8  # per operation, per mode (valid requests, and requests that break the document)


@pytest.fixture
def federation(db):
    from routing import services as routing_services

    routing_services.forget_published_version()
    fed = build_federation()
    review = add_review_data(fed, embed=True)  # the router answers from round 2's global
    yield fed, review
    routing_services.forget_published_version()


@pytest.fixture
def api_schema(federation):
    from django.core.wsgi import get_wsgi_application

    application = get_wsgi_application()  # not synapse_web.wsgi's, which closes connections
    # The application in-process, as Django's test client runs it: the end of a request must
    # not close the connection that holds the test's transaction.
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield schemathesis.openapi.from_wsgi("/api/schema/?format=json", application)
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.fixture
def callers(federation):
    fed, review = federation
    tokens = {
        "operator": services.issue_user_token(SYSTEM, fed.operator),
        "admin": services.issue_user_token(SYSTEM, review.acme_admin),
        "member": services.issue_user_token(SYSTEM, review.acme_member),
        "client": services.rotate_client_token(SYSTEM, fed.clients[0]).token,
    }
    # identity: the in-process transport does not decode a gzip body as an HTTP client would
    return {
        who: {"Authorization": f"Bearer {token}", "Accept-Encoding": "identity"}
        for who, token in tokens.items()
    }


def _failures(operation, mode, callers, statuses) -> list[str]:
    found: list[str] = []

    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        for who, headers in callers.items():
            response = case.call(headers=headers)
            statuses.setdefault(operation.label, set()).add(response.status_code)
            checks = CHECKS
            if response.status_code == 503 and "503" in operation.definition.raw["responses"]:
                checks = CHECKS[1:]  # documented: the router is not there yet (no global)
            try:
                case.validate_response(response, checks=checks)
            except (Exception, BaseExceptionGroup) as exc:  # kept, with the request that caused it
                found.append(f"{operation.label} ({mode.value}, as the {who}): {exc}")

    run()
    return found


def test_every_answer_is_what_the_openapi_document_says(api_schema, callers):
    operations = [result.ok() for result in api_schema.get_all_operations()]
    # What only reads first (lists, the global, routing), then what changes the federation (the
    # operator may revoke the client, rotate its token or deactivate a person on the way).
    operations.sort(key=lambda op: op.method.upper() != "GET" and "/route/" not in op.path)
    assert len(operations) >= 30  # the whole API, not an empty document
    statuses: dict[str, set[int]] = {}
    failures = [
        failure
        for operation in operations
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
        for failure in _failures(operation, mode, callers, statuses)
    ]
    # The answers checked include real ones, not only refusals: a decision of the router, the
    # published global, a page of each list.
    for label in ("POST /api/v1/route/", "POST /api/v1/route/batch/", "GET /api/v1/rounds/",
                  "GET /api/v1/compendium/global/", "GET /api/v1/admin/people/",
                  "GET /api/v1/admin/audit/", "GET /api/v1/submissions/"):
        assert 200 in statuses[label], (label, statuses[label])
    assert not failures, f"{len(failures)} answers differ from the document:\n\n" + "\n\n".join(
        failures[:30]
    )


def test_field_errors_get_a_detail_naming_each_field():
    from synapse_web.api_errors import error_body

    body = error_body({"tau": ["A valid number is required."],
                       "non_field_errors": ["Pick one."],
                       "queries": [{"text": ["Too long."]}, {}]})
    assert body["detail"] == "tau: A valid number is required.; Pick one.; queries[0].text: Too long."
    assert body["errors"]["tau"] == ["A valid number is required."]
    assert error_body({"detail": "no such round", "code": "x"}) == {"detail": "no such round", "code": "x"}
    assert error_body(["Refused."]) == {"detail": "Refused.", "errors": ["Refused."]}


def test_every_operation_is_documented_for_its_reader():
    """Each operation has a summary, and no description is a base class's note to developers
    (a view without a docstring inherits its base's, which drf-spectacular publishes)."""
    from drf_spectacular.generators import SchemaGenerator

    document = SchemaGenerator().get_schema(request=None, public=True)
    operations = [
        (f"{method.upper()} {path}", operation)
        for path, item in document["paths"].items()
        for method, operation in item.items()
    ]
    assert len(operations) >= 30
    for label, operation in operations:
        assert operation.get("summary"), label
        description = str(operation.get("description", ""))
        assert "Maps the services" not in description and "Base of" not in description, label
