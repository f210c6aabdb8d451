"""The Megatron <-> Hugging Face tables (modelopt_moe/export/mapping.py): each family's Megatron table holds exactly
its canonical tensors, and a malformed table entry is refused when the table is written."""

from dataclasses import replace

import pytest

from modelopt_moe.export.families import FAMILIES, MoEArch, canonical_names
from modelopt_moe.export.mapping import Param


def _table_names(family, arch: MoEArch) -> list[str]:
    table, names = family.megatron, []
    for key, layer in [("embedding", None), *[(L, L) for L in range(arch.num_layers)], ("final", None)]:
        for p in table.params(arch, key):
            experts = range(arch.num_experts) if p.expert else (None,)
            names += [c.format(L=layer, E=e) for e in experts for c in p.canonical]
    return names


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("tie", [False, True])
def test_every_family_table_holds_exactly_its_canonical_tensors(name, tie):
    arch = MoEArch(family=name, vocab_size=96, hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                   head_dim=16, moe_ffn_hidden_size=32, num_experts=3, top_k=2, norm_eps=1e-6, rope_theta=1e6,
                   max_position_embeddings=128, qk_norm=FAMILIES[name].qk_norm is not False, tie_word_embeddings=tie)
    if name == "deepseek_v3":
        arch = replace(arch, num_kv_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16,
                       shared_expert_ffn_hidden_size=32, first_dense_layers=1, dense_ffn_hidden_size=96,
                       router_score_function="sigmoid", router_expert_bias=True)
    if name == "glm4_moe":  # q/k/v biases, q/k norm, a dense first layer, shared experts
        arch = replace(arch, qkv_bias=True, rotary_percent=0.5, shared_expert_ffn_hidden_size=32, first_dense_layers=1,
                       dense_ffn_hidden_size=96, router_score_function="sigmoid", router_expert_bias=True)
    names = _table_names(FAMILIES[name], arch)
    assert len(names) == len(set(names))
    assert sorted(names) == sorted(canonical_names(arch))


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(rule="split"), r"rule 'split', expected one of"),
    (dict(rule="qkv"), r"rule 'qkv' holds 3 canonical tensors, the table names 1"),
    (dict(rule="row", when="sparse"), r"when='sparse', expected one of"),
])
def test_a_malformed_entry_is_refused_naming_it(kwargs, match):
    with pytest.raises(ValueError, match=r"decoder\.x\.weight: " + match):
        Param("decoder.x.weight", canonical="layers.{L}.x", **kwargs)
