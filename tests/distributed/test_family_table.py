"""A new Llama-shaped family is one file: the family below is defined in this file alone (its Hugging Face tensor names
and config class), registered with ``modelopt_moe.export.register_family``, and imports and exports through the
generic table walkers at TP2 (2 gloo ranks) with no other change.

Its checkpoint is a tiny random ``Qwen3MoeForCausalLM`` saved by ``transformers`` with every tensor renamed to the
family's names: ``import_hf`` then ``export_hf(format="hf")`` gives back every tensor bit for bit under the family's
names, and the fp32 Megatron model's logits equal transformers' on the original model.
"""

import json
from pathlib import Path

import pytest
import torch
from limits import seconds  # noqa: E402

from modelopt_moe.export.families import Qwen3MoeFamily
from modelopt_moe.launch import spawn

WORLD, TP = 2, 2


class RenamedMoeFamily(Qwen3MoeFamily):
    """Qwen3-MoE's architecture under other tensor names: all a Llama-shaped family has to declare."""

    name = "renamed_moe"
    architecture = "RenamedMoeForCausalLM"
    model_type = "renamed_moe"
    top_tensors = {"embed_tokens": "model.tok.weight", "norm": "model.final_norm.weight", "lm_head": "head.weight"}
    layer_tensors = {"input_norm": "ln1.weight", **{p: f"attn.{p[0]}.weight" for p in ("q_proj", "k_proj", "v_proj",
                                                                                        "o_proj")},
                     "q_norm": "attn.qn.weight", "k_norm": "attn.kn.weight", "post_attn_norm": "ln2.weight",
                     "router": "moe.router.weight",
                     **{f"experts.{{E}}.{k}": f"moe.e.{{E}}.{k}.weight" for k in ("gate", "up", "down")}}


def _save(path: Path) -> None:
    """Qwen3-MoE saved by transformers, renamed to the family's tensor names; the original beside it."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from modelopt_moe.export import get_family

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32, max_position_embeddings=64, norm_topk_prob=True)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path / "qwen3")
    qwen, ours = get_family("qwen3_moe"), RenamedMoeFamily()
    tensors = load_file(path / "qwen3" / "model.safetensors")
    (path / "renamed").mkdir()
    save_file({ours.hf_tensor(qwen.canonical_tensor(k)): v for k, v in tensors.items()},
              path / "renamed" / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "qwen3" / "config.json").read_text())
    cfg.update(architectures=[ours.architecture], model_type=ours.model_type)
    (path / "renamed" / "config.json").write_text(json.dumps(cfg))


def _rank(rank, world_size, base):
    from megatron.core import parallel_state, tensor_parallel

    from modelopt_moe.export import build_megatron_model, export_hf, import_hf, register_family
    from modelopt_moe.plugins.megatron_cpu import apply_cpu_shims

    register_family(RenamedMoeFamily())
    apply_cpu_shims()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    tensor_parallel.model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)
    src = Path(base) / "renamed"
    model = build_megatron_model(src, params_dtype=torch.float32)
    import_hf(model, src)
    model.eval()
    export_hf(model, Path(base) / "export", format="hf", dtype=torch.float32, family="renamed_moe", progress=False)
    torch.manual_seed(1)
    tokens = torch.randint(0, 128, (2, 12))
    causal = torch.triu(torch.ones(12, 12, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        logits = model(tokens, torch.arange(12).expand(2, 12), causal, runtime_gather_output=True)
    parallel_state.destroy_model_parallel()
    return {"tokens": tokens, "logits": logits}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("family_table")
    _save(base)
    return base, spawn(_rank, WORLD, args=(str(base),), timeout=seconds(600))[0]


def test_a_family_declared_in_one_file_round_trips_bit_exact(run):
    from safetensors.torch import load_file

    base, _ = run
    source = load_file(base / "renamed" / "model.safetensors")
    exported = {}
    for f in (base / "export").glob("*.safetensors"):
        exported.update(load_file(f))
    assert sorted(exported) == sorted(source)
    for name, t in source.items():
        assert torch.equal(exported[name], t.float()), name
    assert json.loads((base / "export" / "config.json").read_text())["architectures"] == ["RenamedMoeForCausalLM"]


def test_megatron_logits_of_the_new_family_match_transformers(run):
    from transformers import AutoModelForCausalLM

    base, out = run
    hf = AutoModelForCausalLM.from_pretrained(base / "qwen3", dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(out["tokens"]).logits
    assert (out["logits"] - ref).abs().max() <= 2e-5 * ref.abs().max()
