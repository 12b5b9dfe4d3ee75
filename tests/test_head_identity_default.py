"""--head-identity-weight's default follows the dev split: 4 for TARQ's IQ2_S and IQ2_XS (rare KLD and decoded capped WER
lower beyond their intervals, results/head-identity), 1 everywhere else (at IQ3_S every other value measured was
worse); a value given is always kept."""
from __future__ import annotations

import pytest

from helpers import quantize_options_for

from tarq_deploy import cli


@pytest.mark.parametrize("method, type_name, expected", [("tarq", "iq2_xs", 4.0), ("tarq", "iq3_s", 1.0),
                                                         ("tarq", "iq2_s", 4.0), ("gptq", "iq2_xs", 1.0),
                                                         ("tarq", "q4_0", 1.0)])
def test_the_default_mu_is_the_one_the_dev_split_measured(method, type_name, expected):
    assert quantize_options_for(method=method, type=type_name).head_identity_weight == expected
    given = quantize_options_for(method=method, type=type_name, head_identity_weight=2.5)
    assert given.head_identity_weight == 2.5


def test_the_default_is_written_in_help():
    help_text = " ".join(cli.build_parser()._subparsers._group_actions[0].choices["quantize"].format_help().split())
    assert "4 for tarq at iq2_s and iq2_xs" in help_text
