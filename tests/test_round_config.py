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
