"""Qwen3.5 MoE (``Qwen3_5MoeForCausalLM``) is not mapped, and says why (docs/export.md, "Qwen3.5 MoE: not mapped, and
why"): a tiny checkpoint written by ``transformers`` 5.23 (Gated DeltaNet layers interleaved with gated attention, a
shared expert with its gate) is refused by ``build_megatron_model`` and ``import_hf`` with an error that names the
Gated DeltaNet layers and where Megatron-Core 0.19.2's pieces fall short, before anything is built or written.
"""

from pathlib import Path

import pytest
import torch
from limits import seconds  # noqa: E402

from modelopt_moe.launch import spawn

TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2, max_position_embeddings=128,
            router_aux_loss_coef=0.0)


def _save(path: Path) -> None:
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**TINY)).to(torch.bfloat16)
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    model.save_pretrained(path)


def _rank(rank, world_size, src):
    from modelopt_moe.export import ExportError, build_megatron_model, import_hf
    from modelopt_moe.plugins.megatron import destroy_model_parallel, init_model_parallel
    from modelopt_moe.quantization.config import preset_path

    init_model_parallel(1, 1)
    res = {}
    try:
        build_megatron_model(src, params_dtype=torch.float32)
    except ExportError as e:
        res["build"] = str(e)
    model = build_megatron_model(preset_path("qwen3_moe_tiny.json"), params_dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    try:
        import_hf(model, src)
    except ExportError as e:
        res["import"] = str(e)
    after = model.state_dict()
    res["unchanged"] = all(torch.equal(v, after[k]) for k, v in before.items())
    destroy_model_parallel()
    return res


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    src = tmp_path_factory.mktemp("qwen3_5_moe") / "src"
    _save(src)
    return spawn(_rank, 1, args=(str(src),), timeout=seconds(300))[0]


@pytest.mark.parametrize("call", ["build", "import"])
def test_build_and_import_refuse_qwen3_5_moe_naming_the_reason(run, call):
    message = run[call]
    assert "architectures=['Qwen3_5MoeForCausalLM'] (model_type='qwen3_5_moe_text'): Qwen3.5 MoE is not mapped" \
        in message, message
    assert "Gated DeltaNet layers (layer_types 'linear_attention'" in message, message
    assert "flash-linear-attention" in message, message
    assert "layernorm_zero_centered_gamma" in message, message
    assert "docs/export.md, 'Qwen3.5 MoE: not mapped, and why'" in message, message


def test_the_refused_import_leaves_the_model_as_it_was(run):
    assert run["unchanged"]


def test_the_docs_section_the_error_names_exists():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "export.md").read_text()
    assert "### Qwen3.5 MoE: not mapped, and why" in docs
