"""The engine-contract rules are consistent data: every engine rule names a format rule, every fused role and every
collapse exists there; the engine-order forward decodes the static-scale schemes (FP8 per tensor / channel, NVFP4)."""

import pytest

from modelopt_moe.export.check_rules import ENGINE_RULES, ENGINES, FORMAT_RULES
from modelopt_moe.export.engine_forward import _DECODE


@pytest.mark.parametrize("key", sorted(ENGINE_RULES))
def test_every_engine_rule_points_at_a_format_rule_with_its_roles(key):
    engine, fmt, scheme = key
    assert engine in ENGINES
    rule = FORMAT_RULES[(fmt, scheme)]
    for role, how in ENGINE_RULES[key].gate_up.items():
        assert rule.role(role) is not None, (key, role)
        assert how in ("equal", "max")
    assert ENGINE_RULES[key].input_collapse in ("layer", "expert", "none")


@pytest.mark.parametrize("key", sorted(k for k in FORMAT_RULES if FORMAT_RULES[k].role("input_scale") is not None))
def test_every_scheme_with_a_static_input_scale_has_a_decoder_for_the_engine_order_forward(key):
    assert key in _DECODE


@pytest.mark.parametrize("key", sorted(FORMAT_RULES))
def test_every_format_rule_has_one_weight_and_amax_conversions(key):
    rule = FORMAT_RULES[key]
    assert [t.role for t in rule.tensors].count("weight") == 1
    for t in rule.tensors:
        if t.role in ("weight_scale", "input_scale"):
            assert t.amax(0.5) > 0, t  # a positive scale stands for a positive amax in either convention
