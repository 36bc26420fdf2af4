"""Domain errors of the federation services. Each carries the HTTP status the API answers with,
so views stay thin and a refused operation is never a 500."""

from __future__ import annotations


class FederationError(Exception):
    status_code = 400
    # A stable machine-readable name, sent as the response's "code" where a client acts on it.
    code: str | None = None

    def __init__(self, detail: str):
        super().__init__(detail)
        self.detail = detail


class InvalidRequest(FederationError):
    status_code = 400


class UnknownDictionary(InvalidRequest):
    """A dcz body names a dictionary the server does not hold; the client sends gzip instead."""

    code = "unknown_dictionary"


class NotAllowed(FederationError):
    status_code = 403


class NotFound(FederationError):
    status_code = 404


class Conflict(FederationError):
    status_code = 409


class Busy(Conflict):
    """A lock the operation needs is held by a long operation (an erasure re-merging holds the
    rounds' and the settings' locks until it commits): try again once it has finished."""

    code = "busy"


class InvalidTransition(Conflict):
    """A round or client cannot go from its current state to the requested one."""


class NoOpenRound(Conflict):
    def __init__(self, detail: str = "no round is open"):
        super().__init__(detail)


class BudgetExceeded(Conflict):
    pass


class IdempotencyMismatch(FederationError):
    status_code = 422


class RateLimited(FederationError):
    status_code = 429

    def __init__(self, detail: str, retry_after: int):
        super().__init__(detail)
        self.retry_after = max(1, int(retry_after))


class PayloadTooLarge(FederationError):
    status_code = 413


class UnsupportedEncoding(FederationError):
    status_code = 415


class UnsupportedMediaType(FederationError):
    status_code = 415


class LengthRequired(FederationError):
    status_code = 411


class RoundChanged(Conflict):
    """The round a submission was checked against stopped taking submissions and another one
    opened meanwhile: its masking strength, field cap and schema were not checked for that
    one."""

    code = "round_changed"


class SchemaChanged(Conflict):
    """The tool registry or the declared numeric fields changed while a submission was checked
    against them: the merge would hold it to another schema."""

    code = "schema_changed"


class Replaced(Conflict):
    """A submission replayed under its Idempotency-Key was replaced by a later submission of the
    same client in its round: replaying its answer would tell the client it is in effect while
    the later one is. While the round takes submissions a new key submits it again, and it
    replaces the later one; after, nothing can put it back."""

    code = "replaced"
