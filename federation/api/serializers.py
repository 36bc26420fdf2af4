"""Serializers of the federation API: shapes of requests and responses (and of the OpenAPI)."""

from __future__ import annotations

from django.db import models
from rest_framework import serializers

from compendium.schema import (
    FIELD_CAP_MAX,
    AnnexTriple,
    MaskingInfo,
    Precaution,
    PromptTemplate,
    Scenario,
    ToolMetadata,
)
from federation.models import (
    AuditLog,
    Client,
    FederationSettings,
    Membership,
    Organization,
    Round,
    Submission,
)
from federation.round_config import RoundConfig


class NumberField(serializers.FloatField):
    """A number: DRF's FloatField, refusing true and false, which Python reads as 1.0 and 0.0
    (a round's λ of false was opened as 0)."""

    def to_internal_value(self, data):
        if isinstance(data, bool):
            self.fail("invalid")
        return super().to_internal_value(data)


class DetailSerializer(serializers.Serializer):
    """Every error of the API (synapse_web.api_errors)."""

    detail = serializers.CharField(help_text="what is wrong, in one sentence")
    code = serializers.CharField(required=False, help_text="a stable code, where one is defined")
    errors = serializers.JSONField(
        required=False,
        help_text="a request's field errors, per field ({\"tau\": [\"A valid number is required.\"]})",
    )


class ViolationSerializer(serializers.Serializer):
    path = serializers.CharField(help_text="JSON path of the offending value, e.g. $.scenarios[3].tool_id")
    reason = serializers.CharField()


class InvalidSubmissionSerializer(DetailSerializer):
    violations = ViolationSerializer(
        many=True, required=False,
        help_text="each rule the compendium breaks, where the body was a compendium to check",
    )


def _entries(model, what: str) -> serializers.ListField:
    return serializers.ListField(
        child=serializers.DictField(), required=False,
        help_text=f"{what}: objects with {', '.join(model.model_fields)}",
    )


class CompendiumBodySerializer(serializers.Serializer):
    """What a client POSTs to /api/v1/submissions/: its compendium C = (M, U, P, T, A) as JSON
    (compendium.schema.Compendium, whose fields these mirror; the limits are the schema's, GET
    /api/v1/compendium/schema/). It describes the body to OPTIONS and the browsable API only:
    the view reads the body raw and the submission checks it whole."""

    schema_version = serializers.CharField(
        required=False, help_text="the schema version it was built under (default: the current)"
    )
    metadata = _entries(ToolMetadata, "M, per tool")
    scenarios = _entries(Scenario, "U, usage scenarios")
    precautions = _entries(Precaution, "P, precautions")
    templates = _entries(PromptTemplate, "T, prompt templates")
    annex = _entries(AnnexTriple, "A, annex triples")
    masking = serializers.DictField(
        required=False, allow_null=True,
        help_text=f"how its texts were masked: {', '.join(MaskingInfo.model_fields)}",
    )
    num_users = serializers.IntegerField(
        required=False, allow_null=True, min_value=1, help_text="users its statistics are over"
    )
    field_cap = serializers.IntegerField(
        required=False, allow_null=True, min_value=1, max_value=FIELD_CAP_MAX,
        help_text="F*: the most tools whose numeric statistics one user fed",
    )


class SubmissionResultSerializer(serializers.Serializer):
    id = serializers.IntegerField(help_text="the submission (one per idempotency key)")
    round = serializers.IntegerField(help_text="round number")
    round_id = serializers.IntegerField()
    client = serializers.IntegerField()
    version = serializers.IntegerField(help_text="the stored compendium version")
    sha256 = serializers.CharField(help_text="SHA-256 of the canonical bytes")
    size_bytes = serializers.IntegerField()
    gzip_bytes = serializers.IntegerField()
    entry_counts = serializers.DictField(child=serializers.IntegerField())
    scrubbed = serializers.IntegerField(help_text="personal data items removed on arrival")
    replaced = serializers.BooleanField(help_text="an earlier submission of this round was replaced")


class RoundSerializer(serializers.ModelSerializer):
    failure_reason = serializers.SerializerMethodField(
        help_text="why a failed round failed: in full for the operator; for everyone else that "
        "it failed (the reason can quote any organization's merge)"
    )
    submissions = serializers.IntegerField(
        source="n_submissions", read_only=True, help_text="client compendiums stored"
    )
    organizations = serializers.IntegerField(
        source="n_organizations", read_only=True, help_text="organizations that submitted"
    )
    submitted_bytes = serializers.IntegerField(
        source="n_submitted_bytes", read_only=True, allow_null=True
    )
    submitted_gzip_bytes = serializers.IntegerField(
        source="n_submitted_gzip_bytes", read_only=True, allow_null=True
    )
    fields_not_released = serializers.ListField(
        child=serializers.CharField(), read_only=True,
        help_text="the numeric fields the round's edges do not release, fixed when it opened (no "
        "release of it could make them useful with the clients approved then: the noise would "
        "be at least as wide as each field's clipping window [min, min(max, min + Δ)]); a client "
        "need not compute or send them",
    )

    probe_accuracy = serializers.SerializerMethodField(
        help_text="once the round is published: its global's top-1 on the public probe set "
        "(each probe request routed to the tool of its nearest scenario), as the server merge "
        "measured it; a health check of the rounds, not a held-out accuracy (the probe set also "
        "picks the summaries and trains the routing head). Null before publication or without a "
        "probe set"
    )
    probe_queries = serializers.SerializerMethodField(
        help_text="how many public probe requests probe_accuracy is over (0 when it is null)"
    )

    class Meta:
        model = Round
        fields = [
            "id",
            "number",
            "state",
            "config",
            "failure_reason",
            "opened_at",
            "closes_at",
            "closed_at",
            "published_at",
            "submissions",
            "organizations",
            "submitted_bytes",
            "submitted_gzip_bytes",
            "fields_not_released",
            "probe_accuracy",
            "probe_queries",
        ]

    def get_probe_accuracy(self, rnd) -> float | None:
        return self._probe(rnd)[0]

    def get_probe_queries(self, rnd) -> int:
        return self._probe(rnd)[1]

    @staticmethod
    def _probe(rnd) -> tuple[float | None, int]:
        accuracy = getattr(rnd, "merge_probe_accuracy", None)
        if rnd.state != Round.State.PUBLISHED or accuracy is None:
            return None, 0
        return round(accuracy, 4), int(getattr(rnd, "merge_probe_queries", 0) or 0)

    def get_failure_reason(self, rnd) -> str:
        from federation.services import failure_reason_for

        request = self.context.get("request")
        return failure_reason_for(request.user if request is not None else None, rnd)


class RoundConfigSerializer(serializers.Serializer):
    """The replayable configuration of a round (every field optional: defaults apply)."""

    tau = NumberField(required=False)
    epsilon = NumberField(required=False)
    field_cap = serializers.IntegerField(required=False, allow_null=True)
    mask_strength = NumberField(required=False)
    summarizer = serializers.ChoiceField(
        choices=list(RoundConfig.model_fields["summarizer"].annotation.__args__), required=False
    )
    textgrad_steps = serializers.IntegerField(required=False)
    robust_rule = serializers.ChoiceField(
        choices=list(RoundConfig.model_fields["robust_rule"].annotation.__args__), required=False
    )
    trim_fraction = NumberField(required=False)
    seed = serializers.IntegerField(required=False)
    global_metadata = serializers.ChoiceField(choices=["full", "stats"], required=False)
    max_scenarios_per_tool = serializers.IntegerField(required=False, allow_null=True)
    carry_forward = serializers.BooleanField(required=False)


class OpenRoundSerializer(RoundConfigSerializer):
    """A round's configuration and, optionally, its deadline (not part of the configuration)."""

    closes_at = serializers.DateTimeField(
        required=False,
        allow_null=True,
        help_text="ISO 8601, in the future (without a time zone: UTC, as on the dashboard): "
        "submissions stop then and the round closes itself",
    )


class DeadlineSerializer(serializers.Serializer):
    closes_at = serializers.DateTimeField(
        allow_null=True,
        help_text="the new deadline (ISO 8601, in the future; without a time zone: UTC), or null "
        "for none",
    )


class FailRoundSerializer(serializers.Serializer):
    reason = serializers.CharField(max_length=2000)


class GlobalCompendiumSerializer(serializers.Serializer):
    round = serializers.IntegerField()
    sha256 = serializers.CharField()
    published_at = serializers.DateTimeField()
    compendium = serializers.JSONField()


class OrganizationSerializer(serializers.ModelSerializer):
    class Meta:
        model = Organization
        fields = ["id", "name", "slug", "description", "created_at"]
        read_only_fields = ["id", "created_at"]
        # Uniqueness is the service's to check: a taken name or slug is a 409, as a rename's is.
        extra_kwargs = {"slug": {"required": False, "validators": []}, "name": {"validators": []}}


class RenameOrganizationSerializer(serializers.Serializer):
    """Only the name changes; the slug stays (a slug sent must be the current one)."""

    # Checked by the service (empty, too long, taken), which says what is wrong.
    name = serializers.CharField(allow_blank=True, trim_whitespace=False)
    slug = serializers.CharField(
        required=False, help_text="immutable: if sent, it must be the organization's current slug"
    )


class ClientSerializer(serializers.ModelSerializer):
    organization = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    contact = serializers.CharField(
        read_only=True, allow_null=True,
        help_text="whom to reach about the client (an e-mail address): for the organization's "
        "admins and the operator; null for a read-only member",
    )
    token_prefix = serializers.SerializerMethodField()
    token_issued_at = serializers.SerializerMethodField()

    class Meta:
        model = Client
        fields = [
            "id",
            "organization",
            "name",
            "description",
            "contact",
            "status",
            "created_at",
            "token_prefix",
            "token_issued_at",
        ]

    def to_representation(self, instance):
        """A read-only member sees its organization's clients, not whom to reach about each (a
        person's e-mail address, as a colleague's in the people list): that is for its admins and
        the operator."""
        from federation.services import Actor, can_admin

        data = super().to_representation(instance)
        request = self.context.get("request")
        if request is not None and not can_admin(
            Actor.for_user(request.user), instance.organization_id
        ):
            data["contact"] = None
        return data

    def _token(self, obj):
        try:
            return obj.token
        except Client.token.RelatedObjectDoesNotExist:
            return None

    def get_token_prefix(self, obj) -> str | None:
        token = self._token(obj)
        return token.prefix if token else None

    def get_token_issued_at(self, obj) -> str | None:
        # Written as DRF writes `created_at` (and every other time): "…Z", not isoformat's "+00:00".
        token = self._token(obj)
        return serializers.DateTimeField().to_representation(token.issued_at) if token else None


class EnrollSerializer(serializers.Serializer):
    organization = serializers.SlugField(
        required=False, help_text="slug; needed by the operator, implied for an organization admin"
    )
    name = serializers.CharField(max_length=200)
    description = serializers.CharField(required=False, allow_blank=True, default="")
    contact = serializers.CharField(max_length=254, required=False, allow_blank=True, default="")


class RevokeSerializer(serializers.Serializer):
    reason = serializers.CharField(required=False, allow_blank=True, default="")


class IssuedTokenSerializer(serializers.Serializer):
    client = ClientSerializer()
    token = serializers.CharField(help_text="shown once; store it now, only its hash is kept")


class PersonSerializer(serializers.ModelSerializer):
    """A person of an organization (its membership and login); never the password."""

    id = serializers.IntegerField(source="user.id", read_only=True)
    username = serializers.CharField(source="user.username", read_only=True)
    email = serializers.CharField(
        source="user.email", read_only=True, allow_null=True,
        help_text="null for a read-only member looking at someone else",
    )
    organization = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    is_active = serializers.BooleanField(source="user.is_active", read_only=True)
    last_login = serializers.DateTimeField(
        source="user.last_login", read_only=True, allow_null=True,
        help_text="null before the first sign-in, and for a read-only member looking at someone "
        "else",
    )
    date_joined = serializers.DateTimeField(source="user.date_joined", read_only=True)

    class Meta:
        model = Membership
        fields = [
            "id", "username", "email", "organization", "role", "is_active", "last_login",
            "date_joined",
        ]

    def to_representation(self, instance):
        """A read-only member sees who is in the organization and their roles, not the others'
        e-mail addresses or when they last signed in (null): those are for its admins and the
        operator."""
        from federation.services import Actor, can_admin

        data = super().to_representation(instance)
        request = self.context.get("request")
        if (
            request is not None
            and instance.user_id != request.user.pk
            and not can_admin(Actor.for_user(request.user), instance.organization_id)
        ):
            data["email"] = data["last_login"] = None
        return data


class AddPersonSerializer(serializers.Serializer):
    organization = serializers.SlugField(
        required=False, help_text="slug; needed by the operator, implied for an organization admin"
    )
    username = serializers.CharField(max_length=150)
    email = serializers.CharField(max_length=254, required=False, allow_blank=True, default="")
    role = serializers.ChoiceField(choices=Membership.Role.choices, default=Membership.Role.MEMBER)


class ChangePersonSerializer(serializers.Serializer):
    role = serializers.ChoiceField(choices=Membership.Role.choices, required=False)
    is_active = serializers.BooleanField(required=False)


class IssuedPasswordSerializer(serializers.Serializer):
    person = PersonSerializer()
    password = serializers.CharField(
        help_text="shown once; hand it to the person, who can change it after signing in"
    )
    tokens_revoked = serializers.IntegerField(
        help_text="the person's personal API tokens this stopped (a reset stops them all)"
    )


class OwnSubmissionSerializer(serializers.ModelSerializer):
    """One of the calling client's submissions, as the server recorded it."""

    round = serializers.IntegerField(source="round.number", help_text="round number")
    round_state = serializers.CharField(source="round.state")
    sha256 = serializers.SerializerMethodField(help_text="SHA-256 of the canonical bytes")
    size_bytes = serializers.SerializerMethodField()
    entry_counts = serializers.SerializerMethodField()
    in_effect = serializers.SerializerMethodField(
        help_text="false once a later submission in the same round replaced it"
    )

    class Meta:
        model = Submission
        fields = [
            "id", "round", "round_state", "created_at", "idempotency_key", "sha256", "size_bytes",
            "wire_bytes", "content_encoding", "entry_counts", "scrubbed", "in_effect",
        ]

    def get_sha256(self, obj) -> str | None:
        return obj.response.get("sha256")

    def get_size_bytes(self, obj) -> int | None:
        return obj.response.get("size_bytes")

    def get_entry_counts(self, obj) -> dict[str, int]:
        return obj.response.get("entry_counts") or {}

    def get_in_effect(self, obj) -> bool:
        return obj.version_id is not None


class AuditLogSerializer(serializers.ModelSerializer):
    organization = serializers.SlugRelatedField(
        slug_field="slug", read_only=True, allow_null=True,
        help_text="null for what concerns the whole federation",
    )
    actor = serializers.CharField(source="actor_label")

    def to_representation(self, instance):
        """`details` and `ip` as the caller may read them (no colleague's e-mail address or
        address for a read-only member)."""
        from federation.services import audit_entry_for

        data = super().to_representation(instance)
        request = self.context.get("request")
        if request is not None:
            data["details"], data["ip"] = audit_entry_for(request.user, instance)
        return data

    class Meta:
        model = AuditLog
        fields = [
            "id",
            "created_at",
            "actor",
            "action",
            "organization",
            "target_type",
            "target_id",
            "target_label",
            "ip",
            "details",
        ]


class FederationSettingsSerializer(serializers.ModelSerializer):
    serializer_field_mapping = {
        **serializers.ModelSerializer.serializer_field_mapping, models.FloatField: NumberField
    }

    class Meta:
        model = FederationSettings
        fields = [
            "epsilon_budget",
            "delta_prime",
            "allow_admin_approval",
            "max_submission_bytes",
            "submissions_per_minute",
            "enrollments_per_hour",
            "updated_at",
        ]
        read_only_fields = ["updated_at"]
