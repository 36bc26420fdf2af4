"""Organizations, their clients, and federated rounds."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models.fields.json import KeyTransform

from compendium.registry import DATASET_NAME_MAX_LENGTH, QID_MAX_LENGTH, TOOL_ID_MAX_LENGTH


class Organization(models.Model):
    """A member organization; it runs one edge aggregator over its clients."""

    name = models.CharField(max_length=200, unique=True)
    slug = models.SlugField(max_length=100, unique=True)
    description = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Client(models.Model):
    """A machine identity of an organization that submits compendiums."""

    class Status(models.TextChoices):
        PENDING = "pending", "pending approval"
        APPROVED = "approved", "approved"
        REVOKED = "revoked", "revoked"

    organization = models.ForeignKey(Organization, on_delete=models.PROTECT, related_name="clients")
    name = models.CharField(max_length=200)
    description = models.TextField(blank=True)
    contact = models.CharField(max_length=254, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["organization__name", "name"]
        constraints = [
            models.UniqueConstraint(fields=["organization", "name"], name="client_name_unique_in_org")
        ]

    def __str__(self) -> str:
        return f"{self.organization.slug}/{self.name}"


class Round(models.Model):
    """One federated round: open -> closing -> merging -> published (or failed)."""

    class State(models.TextChoices):
        OPEN = "open", "open"
        CLOSING = "closing", "closing"
        MERGING = "merging", "merging"
        PUBLISHED = "published", "published"
        FAILED = "failed", "failed"

    number = models.PositiveIntegerField(unique=True)
    state = models.CharField(max_length=16, choices=State.choices, default=State.OPEN)
    # tau, epsilon per field, lambda expected, summarizer, robust rule, seed: enough to replay it.
    config = models.JSONField(default=dict, blank=True)
    # Numeric fields the round's edges will not release, fixed when it opened (from the approved
    # clients: accounting.fields_not_released); clients leave them out.
    fields_not_released = models.JSONField(default=list, blank=True)
    failure_reason = models.TextField(blank=True)
    # Which run of the merge pipeline is the round's: 1 at the close, one more at each retry. The
    # pipeline's tasks carry it, and those of an earlier run (still running, or delivered late,
    # when the operator failed the round and retried it) change nothing.
    attempt = models.PositiveIntegerField(default=1)
    opened_at = models.DateTimeField(auto_now_add=True)
    # The round's deadline: submissions stop then and `close_due_rounds` closes it (null: the
    # operator closes it by hand).
    closes_at = models.DateTimeField(null=True, blank=True)
    closed_at = models.DateTimeField(null=True, blank=True)
    # When the current run of the merge pipeline started: the close, or the latest retry (what
    # /metrics' synapse_merge_pending_seconds counts from; closed_at stays the close).
    attempt_started_at = models.DateTimeField(null=True, blank=True)
    # The run (`attempt`) whose start of the merges was handed to the broker: set once the start's
    # message is queued. A closing round whose current run was never queued (the process that
    # committed the close died before queuing it) is started again by Celery beat's check
    # (`services.requeue_lost_merges`).
    queued_attempt = models.PositiveIntegerField(null=True, blank=True)
    published_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-number"]
        constraints = [
            models.UniqueConstraint(
                fields=["state"], condition=models.Q(state="open"), name="at_most_one_open_round"
            )
        ]

    def __str__(self) -> str:
        return f"round {self.number} ({self.state})"


class Membership(models.Model):
    """A person's role in one organization. The federation operator is a superuser and needs no
    membership; an organization admin manages its clients; a member only reads."""

    class Role(models.TextChoices):
        ADMIN = "admin", "organization admin"
        MEMBER = "member", "read-only member"

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="membership"
    )
    organization = models.ForeignKey(
        Organization, on_delete=models.CASCADE, related_name="memberships"
    )
    role = models.CharField(max_length=8, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["organization__name", "user__username"]

    def __str__(self) -> str:
        return f"{self.user} ({self.role} of {self.organization.slug})"


class ClientToken(models.Model):
    """The API token of an approved client, stored only as the SHA-256 of a 256-bit secret.

    One row per client: rotation replaces the hash (the old token stops at once), revocation
    marks the row revoked. The unique index on the hash makes authentication one index lookup.
    """

    client = models.OneToOneField(Client, on_delete=models.CASCADE, related_name="token")
    token_hash = models.CharField(max_length=64, unique=True)
    prefix = models.CharField(max_length=16, help_text="first characters, to recognize a token")
    issued_at = models.DateTimeField()
    revoked_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"token {self.prefix}… of {self.client_id}"


class UserToken(models.Model):
    """An API token of a person (operator, organization admin or member) for scripts; stored
    only as a hash, like client tokens."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens"
    )
    token_hash = models.CharField(max_length=64, unique=True)
    prefix = models.CharField(max_length=16)
    label = models.CharField(
        max_length=100, blank=True, help_text="what it is for, as its owner named it"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"token {self.prefix}… of {self.user}"


class ErasureGeneration(models.Model):
    """How many erasures have committed: one row (pk=1; none yet reads as 0), raised in each
    erasure's transaction. A server process compares it with the value its in-memory caches of
    clients' texts were filled under, and forgets them when it moved (`federation.caches`)."""

    value = models.BigIntegerField(default=0)


class FederationSettings(models.Model):
    """The federation's policy: one row (pk=1). Changes are audited."""

    epsilon_budget = models.FloatField(
        default=50.0,
        help_text="cap on the federation's composed ε′ over all rounds (the tighter of basic "
        "and advanced composition at δ′)",
    )
    delta_prime = models.FloatField(default=1e-6, help_text="δ' of advanced composition")
    allow_admin_approval = models.BooleanField(
        default=False, help_text="organization admins may approve their own clients"
    )
    max_submission_bytes = models.PositiveIntegerField(
        default=2 * 1024 * 1024,
        help_text="largest accepted submission body (also capped by SYNAPSE_MAX_SUBMISSION_BYTES)",
    )
    submissions_per_minute = models.PositiveIntegerField(
        default=60,
        help_text="submissions one client may send per minute (0: none for now, each refused "
        "with 429)",
    )
    enrollments_per_hour = models.PositiveIntegerField(
        default=20,
        help_text="clients one organization's admins may enroll per hour (0: only the operator "
        "enrolls)",
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "federation settings"
        constraints = [models.CheckConstraint(condition=models.Q(pk=1), name="settings_singleton")]

    def __str__(self) -> str:
        return "federation settings"


class Submission(models.Model):
    """A client's accepted submission under one idempotency key, with the response it got.

    The compendium itself is the CompendiumVersion (kind=client); a later submission of the same
    client in the same round replaces that version, and `version` becomes null here.
    """

    client = models.ForeignKey(Client, on_delete=models.CASCADE, related_name="submissions")
    round = models.ForeignKey(Round, on_delete=models.CASCADE, related_name="submissions")
    idempotency_key = models.CharField(max_length=200)
    request_sha256 = models.CharField(max_length=64)
    version = models.OneToOneField(
        "compendium.CompendiumVersion",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="submission",
    )
    status_code = models.PositiveSmallIntegerField(default=201)
    response = models.JSONField()
    scrubbed = models.PositiveIntegerField(default=0, help_text="personal data items scrubbed")
    # The request body as it came over the wire: its size and Content-Encoding ("" when plain;
    # gzip, or dcz against a dictionary the server holds). Null for rows from before it was kept.
    wire_bytes = models.PositiveIntegerField(null=True, blank=True)
    content_encoding = models.CharField(max_length=16, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["client", "idempotency_key"], name="one_submission_per_idempotency_key"
            )
        ]

    def __str__(self) -> str:
        return f"submission {self.idempotency_key!r} of client {self.client_id}"


class RateCounter(models.Model):
    """A fixed-window counter shared by every server process (one upsert per hit)."""

    key = models.CharField(max_length=200)
    window_start = models.DateTimeField()
    count = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["key", "window_start"], name="one_counter_per_window")
        ]


class AuditQuerySet(models.QuerySet):
    def update(self, **kwargs):
        raise AppendOnlyError("the audit log is append-only: entries cannot be updated")

    def delete(self):
        raise AppendOnlyError("the audit log is append-only: entries cannot be deleted")


class AppendOnlyError(Exception):
    pass


class AuditLog(models.Model):
    """Append-only record of every change of state: who, what, when, from where, on what.

    Updates and deletes are refused by the model and, below it, by a database trigger.
    """

    class Action(models.TextChoices):
        ORGANIZATION_CREATE = "organization.create"
        ORGANIZATION_RENAME = "organization.rename"
        CLIENT_ENROLL = "client.enroll"
        CLIENT_APPROVE = "client.approve"
        CLIENT_ROTATE = "client.rotate"
        CLIENT_REVOKE = "client.revoke"
        # `manage.py erase_client`: the client's submissions removed, what held them merged again.
        CLIENT_ERASE = "client.erase"
        ROUND_OPEN = "round.open"
        ROUND_CLOSE = "round.close"
        ROUND_MERGING = "round.merging"
        ROUND_PUBLISH = "round.publish"
        ROUND_FAIL = "round.fail"
        ROUND_RETRY = "round.retry"
        # A closing round whose start of the merges was never queued, started again as a new run.
        ROUND_REQUEUE = "round.requeue"
        ROUND_DEADLINE = "round.deadline"
        SETTINGS_CHANGE = "settings.change"
        MEMBERSHIP_SET = "membership.set"
        CONFLICT_DECIDE = "conflict.decide"
        PERSON_ADD = "person.add"
        PERSON_ROLE = "person.role"
        PERSON_PASSWORD_RESET = "person.password_reset"
        PERSON_DEACTIVATE = "person.deactivate"
        PERSON_REACTIVATE = "person.reactivate"
        PASSWORD_CHANGE = "person.password_change"
        TOKEN_ISSUE = "token.issue"
        TOKEN_REVOKE = "token.revoke"
        LOGIN_THROTTLED = "login.throttled"
        LOGIN_UNLOCK = "login.unlock"
        # Changes to logins made in the Django admin (/admin/auth/user/), the operator's.
        USER_ADD = "user.add"
        USER_CHANGE = "user.change"
        USER_PASSWORD = "user.password"
        USER_DELETE = "user.delete"
        SCHEMA_CHANGE = "schema.change"
        # A client's submission refused for text not masked at the round's λ (nothing stored).
        SUBMISSION_UNMASKED = "submission.unmasked"
        # A client's submission refused by the round's release policy: numeric statistics built
        # without its field cap F* (or a larger one), or for fields it will not release (nothing
        # stored).
        SUBMISSION_POLICY = "submission.policy"

    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="audit_entries",
    )
    actor_label = models.CharField(max_length=200, help_text="who, as text (survives renames)")
    action = models.CharField(max_length=32, choices=Action.choices, db_index=True)
    organization = models.ForeignKey(
        Organization, null=True, blank=True, on_delete=models.PROTECT, related_name="audit_entries"
    )
    target_type = models.CharField(max_length=32)
    target_id = models.CharField(max_length=64, blank=True)
    target_label = models.CharField(max_length=300, blank=True)
    ip = models.GenericIPAddressField(null=True, blank=True)
    details = models.JSONField(default=dict, blank=True)

    objects = AuditQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(fields=["organization", "-created_at"]),
            # The audit page's and the API's filters (`services.filtered_audit_log`): target_type
            # and target_id, newest first, and the round an entry is about, `details__round=N`,
            # whose SQL is ("details" -> 'round') = 'N'::jsonb: the index is on that expression.
            models.Index(fields=["target_type", "target_id", "-created_at"],
                         name="audit_target_created"),
            models.Index(KeyTransform("round", "details"), name="audit_details_round"),
        ]

    def save(self, *args, **kwargs):
        if not self._state.adding:
            raise AppendOnlyError("the audit log is append-only: entries cannot be changed")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise AppendOnlyError("the audit log is append-only: entries cannot be deleted")

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M:%S} {self.actor_label} {self.action} {self.target_label}"
class PrivacyLedgerEntry(models.Model):
    """One numeric release (append-only): the accountant composes these per organization and for
    the federation. Rows are never updated or deleted, so spent budget is never forgotten, also
    not when a client's data is erased and the compendiums are re-materialized."""

    round = models.ForeignKey(Round, on_delete=models.PROTECT, related_name="ledger")
    organization = models.ForeignKey(
        Organization, on_delete=models.PROTECT, related_name="ledger"
    )
    # 0 for the round's first materialization, n for the n-th re-materialization (erasure).
    release = models.PositiveIntegerField(default=0)
    tool_id = models.CharField(max_length=128)
    field = models.CharField(max_length=64)
    sensitivity = models.FloatField()
    contributors = models.PositiveIntegerField()
    epsilon = models.FloatField()
    noise_scale = models.FloatField()
    mechanism = models.CharField(max_length=32, default="laplace")
    field_cap = models.PositiveIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["round__number", "organization_id", "release", "tool_id", "field"]
        constraints = [
            models.UniqueConstraint(
                fields=["round", "organization", "release", "tool_id", "field"],
                name="one_ledger_row_per_release",
            )
        ]

    def save(self, *args, **kwargs):
        if self.pk is not None and not self._state.adding:
            raise PermissionError("the privacy ledger is append-only")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise PermissionError("the privacy ledger is append-only")

    def __str__(self) -> str:
        return f"round {self.round_id} {self.organization_id} {self.tool_id}.{self.field} ε={self.epsilon:g}"


class ConflictLogEntry(models.Model):
    """An entry of an edge's conflict log L(r), keyed by (tool, centroid id). It stays at its
    edge (organization) and becomes next round's precautions there. Entries without an
    organization are the server merge's (conflicts between edges), reviewed by the operator and
    composed into the next global's precautions."""

    round = models.ForeignKey(Round, on_delete=models.CASCADE, related_name="conflicts")
    organization = models.ForeignKey(
        Organization, null=True, blank=True, on_delete=models.CASCADE, related_name="conflicts"
    )
    tool_id = models.CharField(max_length=128)
    centroid_id = models.CharField(max_length=64)
    centroid = models.JSONField()
    dissenters = models.JSONField(default=list)
    reason = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["round__number", "tool_id", "centroid_id"]
        constraints = [
            models.UniqueConstraint(
                fields=["round", "organization", "tool_id", "centroid_id"],
                name="one_conflict_per_centroid",
                nulls_distinct=False,
            )
        ]


class MergeRecord(models.Model):
    """Merge statistics of one edge (organization set) or of the server merge (organization
    null) for a round; the global record also holds the probe-set accuracy."""

    round = models.ForeignKey(Round, on_delete=models.CASCADE, related_name="merge_records")
    organization = models.ForeignKey(
        Organization, null=True, blank=True, on_delete=models.CASCADE, related_name="merge_records"
    )
    stats = models.JSONField(default=dict)
    rejected = models.JSONField(default=list)
    flagged = models.JSONField(default=list)
    accuracy = models.FloatField(null=True, blank=True)
    probe_queries = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["round", "organization"], name="one_merge_record_per_edge"
            ),
            models.UniqueConstraint(
                fields=["round"],
                condition=models.Q(organization__isnull=True),
                name="one_global_merge_record",
            ),
        ]


class ProbeQuery(models.Model):
    """A public labelled query (from a routing benchmark, never client data) used by the
    summarizers and to measure a global compendium's routing accuracy."""

    dataset = models.CharField(max_length=DATASET_NAME_MAX_LENGTH)
    qid = models.CharField(max_length=QID_MAX_LENGTH)
    text = models.TextField()
    tool_id = models.CharField(max_length=TOOL_ID_MAX_LENGTH, db_index=True)

    class Meta:
        ordering = ["dataset", "qid"]
        constraints = [
            models.UniqueConstraint(fields=["dataset", "qid"], name="probe_query_unique")
        ]


class SimulationRun(models.Model):
    """The results of one `manage.py simulate` run, kept for the accuracy dashboards: accuracy per
    round for SYNAPSE and the baselines, per-category table, sweeps, communication, privacy."""

    label = models.CharField(max_length=200, blank=True)
    dataset = models.CharField(max_length=200)
    created_at = models.DateTimeField(auto_now_add=True)
    config = models.JSONField(default=dict)
    document = models.JSONField(help_text="the JSON the command wrote (results, summary, sweeps)")
    seconds = models.FloatField(default=0)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return self.label or f"simulation {self.pk} on {self.dataset}"


class ConflictDecision(models.Model):
    """A reviewer's decision on one conflict of an edge's log (or of the server merge's, with no
    organization: the operator's), keyed like the conflict (round, organization, tool, centroid id)
    so that it survives a re-materialization of that edge.

    The next round's edge (or server) merge applies it (federation.pipeline._previous_conflicts): an accepted
    precaution (while it is still the one composed) or an edited one replaces the composed one,
    a picked scenario wins instead of a precaution
    being composed (only while its text is still one of the conflict's), a dismissed conflict is
    left out. A later decision replaces an earlier one; every decision is audited. An erasure
    that merges the log again removes the decisions that no longer fit it
    (federation.conflicts.remove_unfit_decisions)."""

    class Action(models.TextChoices):
        ACCEPT = "accept", "accept the composed precaution"
        EDIT = "edit", "use an edited precaution"
        SCENARIO = "scenario", "pick the winning scenario"
        DISMISS = "dismiss", "dismiss"

    round = models.ForeignKey(Round, on_delete=models.CASCADE, related_name="conflict_decisions")
    organization = models.ForeignKey(  # null: a conflict of the server merge (the operator's)
        Organization, null=True, blank=True, on_delete=models.CASCADE, related_name="conflict_decisions"
    )
    tool_id = models.CharField(max_length=128)
    centroid_id = models.CharField(max_length=64)
    action = models.CharField(max_length=16, choices=Action.choices)
    text = models.TextField(blank=True, help_text="the precaution or the winning scenario")
    winner_tool_id = models.CharField(
        max_length=128, blank=True, default="",
        help_text="of a picked scenario, the tool it wins for (across tools the centroid and a "
        "dissenter may hold the same text); blank: the first candidate with the text",
    )
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    decided_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["round__number", "tool_id", "centroid_id"]
        constraints = [
            models.UniqueConstraint(
                fields=["round", "organization", "tool_id", "centroid_id"],
                name="one_decision_per_conflict",
                nulls_distinct=False,  # one decision per conflict of the server merge too
            )
        ]

    def __str__(self) -> str:
        return f"{self.action} on {self.tool_id}/{self.centroid_id} (round {self.round_id})"
