import pytest
from pydantic import ValidationError

from federation.round_config import RoundConfig


def test_defaults_follow_the_paper():
    config = RoundConfig()
    assert config.tau == 0.85 and config.textgrad_steps == 3 and config.summarizer == "probe-extractive"


def test_per_field_epsilon_splits_the_round_budget():
    assert RoundConfig(epsilon=1.0).per_field_epsilon(4) == 0.25
    # under a cap F*: ε over the statistics of the 2·F* tools one replaced user can move
    assert RoundConfig(epsilon=1.0, field_cap=1).per_field_epsilon(4) == 0.5
    assert RoundConfig(epsilon=1.0, field_cap=2).per_field_epsilon(4) == 0.25
    assert RoundConfig(epsilon=1.0, field_cap=2).per_field_epsilon(40, fields_per_tool=4) == 1 / 16


def test_bad_config_is_rejected():
    with pytest.raises(ValidationError):
        RoundConfig(tau=1.5)
    with pytest.raises(ValidationError):
        RoundConfig(summarizer="magic")


@pytest.mark.django_db
def test_field_cap_is_bounded_by_the_ledger_column_it_is_written_to():
    from django.db import DataError, transaction

    from federation.models import Organization, PrivacyLedgerEntry, Round

    largest = RoundConfig(field_cap=2**31 - 1).field_cap
    with pytest.raises(ValidationError, match="less than or equal to 2147483647"):
        RoundConfig(field_cap=2**31)
    rnd = Round.objects.create(number=1, config={})
    org = Organization.objects.create(name="Org", slug="org")
    row = dict(round=rnd, organization=org, tool_id="weather", field="calls", sensitivity=50.0,
               contributors=3, epsilon=0.1, noise_scale=1.0)
    PrivacyLedgerEntry.objects.create(**row, field_cap=largest)  # the largest cap an edge writes
    with pytest.raises(DataError), transaction.atomic():  # one more would fail the edge release
        PrivacyLedgerEntry.objects.create(**row, release=1, field_cap=largest + 1)


def test_a_robust_rule_at_a_share_of_zero_is_refused():
    """f = floor(share · n) = 0 in every group: the rule keeps every input, and the merge's
    figures read as judged, nothing dropped."""
    from federation.round_config import config_problems

    for rule in ("krum", "trimmed-mean"):
        with pytest.raises(ValidationError, match=f"robust rule {rule} keep every input"):
            RoundConfig(robust_rule=rule, trim_fraction=0)
        assert config_problems({"robust_rule": rule, "trim_fraction": 0.0},
                               {"trim_fraction": "--trim-fraction"}).startswith(
            f"--trim-fraction: Value error, a share of 0 makes the robust rule {rule} keep")
    assert RoundConfig(robust_rule="none", trim_fraction=0).trim_fraction == 0
    assert RoundConfig(robust_rule="krum", trim_fraction=0.01).trim_fraction == 0.01
