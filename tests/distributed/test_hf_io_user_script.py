"""Hugging Face import and export as a user's own script calls them: public API only (``transformers``,
Megatron-Core's own parallel-state calls, ``modelopt_moe.launch.spawn``, ``modelopt_moe.export``, ``mtq``; on this
CPU machine also the CPU shims docs/export.md names, without which Megatron-Core does not run without CUDA).

One spawn of 4 gloo ranks at TP2 x EP2 does the Megatron work:

* ``import_hf`` of a transformers-saved, sharded Qwen3-MoE checkpoint that is broken in one way each (a missing
  shard, a shard lacking a tensor its index names, a tensor of the wrong shape or dtype, a truncated shard, a config
  of another model) raises the same ``ExportError`` on every rank, naming the file, the tensor and what was expected
  and found, and leaves every parameter and buffer of the model exactly as before (hashed);
* the model, quantized to NVFP4, is exported in compressed-tensors format (rank 0 warns once, naming the affected
  transformers releases and the fix) and in Model Optimizer format (no warning);

then the parent loads the NVFP4 checkpoint with transformers, with ``transformers_compat.fix_nvfp4_experts()`` applied,
and gets the Megatron model's logits.
"""

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from limits import seconds  # noqa: E402

from modelopt_moe.launch import spawn

WORLD, TP, EP = 4, 2, 2
BROKEN = ("missing_shard", "shard_lacks_tensor", "wrong_shape", "wrong_dtype", "truncated_shard", "other_model")
VICTIM = "model.layers.1.mlp.experts.3.down_proj.weight"  # in the last shard; read by EP rank 1 only
INDEX = "model.safetensors.index.json"


def _save_qwen3_moe(path: Path, hidden: int = 64) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=128, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32, max_position_embeddings=64)
    Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(path, max_shard_size="40KB")


def _broken_copies(good: Path, base: Path) -> dict[str, str]:
    """A copy of ``good`` per way of being broken (the shard holding VICTIM is the one damaged)."""
    from safetensors.torch import load_file, save_file

    shard = json.loads((good / INDEX).read_text())["weight_map"][VICTIM]
    paths = {}
    for kind in BROKEN[:-1]:
        path = base / kind
        shutil.copytree(good, path)
        tensors = load_file(path / shard)
        if kind == "missing_shard":
            (path / shard).unlink()
        elif kind == "truncated_shard":
            data = (path / shard).read_bytes()
            (path / shard).write_bytes(data[:-100])
        else:
            if kind == "shard_lacks_tensor":
                del tensors[VICTIM]
            elif kind == "wrong_shape":
                tensors[VICTIM] = tensors[VICTIM][:, :16].contiguous()
            elif kind == "wrong_dtype":
                tensors[VICTIM] = tensors[VICTIM].to(torch.int32)
            save_file(tensors, path / shard, metadata={"format": "pt"})
        paths[kind] = str(path)
    _save_qwen3_moe(base / "other_model", hidden=96)
    paths["other_model"] = str(base / "other_model")
    return paths


# ------------------------------------------------------------------------------------------------ the user's ranks


def _state_hash(model) -> str:
    h = hashlib.sha256()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _user_script(rank, world_size, hf_dir, broken, out_dir):
    import warnings

    from megatron.core import parallel_state, tensor_parallel

    import modelopt_moe.quantization as mtq
    from modelopt_moe.export import ExportError, build_megatron_model, export_hf, import_hf
    from modelopt_moe.plugins.megatron_cpu import apply_cpu_shims  # CPU only: Megatron needs CUDA otherwise

    apply_cpu_shims()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP, expert_model_parallel_size=EP)
    tensor_parallel.model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)
    model = build_megatron_model(hf_dir, params_dtype=torch.float32)
    import_hf(model, hf_dir)
    model.eval()

    errors = {}
    for kind, path in broken.items():
        before = _state_hash(model)
        try:
            import_hf(model, path)
            message = None
        except ExportError as e:  # the documented error
            message = f"ExportError: {e}"
        except Exception as e:  # noqa: BLE001  (any other is a defect, reported by the test)
            message = f"{type(e).__name__} (not an ExportError): {e}"
        errors[kind] = (message, _state_hash(model) == before)

    torch.manual_seed(1)
    tokens = torch.randint(0, 128, (2, 16))
    positions = torch.arange(16).expand(2, 16)
    causal = torch.triu(torch.ones(16, 16, dtype=torch.bool), diagonal=1)[None, None]

    def forward_loop(m):
        with torch.no_grad():
            for b in range(2):
                m(tokens.roll(b, dims=1), positions, causal)

    mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, forward_loop)
    out = Path(out_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_hf(model, out / "nvfp4_modelopt", format="modelopt", progress=False)
        after_modelopt = len(caught)
        export_hf(model, out / "nvfp4_ct", format="compressed-tensors", progress=False)
        export_hf(model, out / "nvfp4_ct_again", format="compressed-tensors", progress=False)
    mtq.disable_quantizer(model, "*input_quantizer")  # transformers runs the experts weight-only
    with torch.no_grad():
        logits = model(tokens, positions, causal, runtime_gather_output=True)
    parallel_state.destroy_model_parallel()
    return {"errors": errors, "warnings_after_modelopt": after_modelopt,
            "warnings": [str(w.message) for w in caught], "logits": logits, "tokens": tokens}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf_io_user")
    good = base / "qwen3_moe"
    _save_qwen3_moe(good)
    assert len({*json.loads((good / INDEX).read_text())["weight_map"].values()}) >= 3  # really sharded
    broken = _broken_copies(good, base)
    (base / "out").mkdir()
    results = spawn(_user_script, WORLD, args=(str(good), broken, str(base / "out")), timeout=seconds(900))
    shard = json.loads((good / INDEX).read_text())["weight_map"][VICTIM]
    return {"results": results, "out": base / "out", "broken": broken, "shard": shard}


EXPECTED = {
    "missing_shard": r"{shard} is missing \(model.safetensors.index.json places \d+ tensors there",
    "shard_lacks_tensor": r"{shard} has no tensor {victim} \(model.safetensors.index.json places it there\)",
    "wrong_shape": r"{shard}: tensor {victim} has shape \[64, 16\], expected \[64, 32\]",
    "wrong_dtype": r"{shard}: tensor {victim} has dtype I32, expected one of BF16, F16, F32",
    "truncated_shard": r"{shard}: truncated: \d+ bytes, but its header places tensor \S+ up to byte \d+",
    "other_model": r"config.json does not match the Megatron model: hidden_size: .* 96, model 64",
}


@pytest.mark.parametrize("kind", BROKEN)
def test_import_hf_of_a_broken_checkpoint_fails_on_every_rank_before_writing_anything(run, kind):
    outcomes = [r["errors"][kind] for r in run["results"]]
    messages = {message for message, _ in outcomes}
    assert len(messages) == 1, messages  # every rank raises, and the same error: no rank goes on alone
    message = messages.pop()
    assert message is not None, f"{kind}: import_hf raised nothing"
    assert message.startswith("ExportError: "), message
    pattern = EXPECTED[kind].format(shard=re.escape(run["shard"]), victim=re.escape(VICTIM))
    assert re.search(pattern, message), message
    assert all(unchanged for _, unchanged in outcomes), f"{kind}: parameters or buffers changed before the error"


def test_export_hf_warns_once_on_rank0_when_it_writes_nvfp4_experts_in_compressed_tensors(run):
    rank0, others = run["results"][0], run["results"][1:]
    assert rank0["warnings_after_modelopt"] == 0  # the Model Optimizer format is not what transformers misreads
    (warning,) = [w for w in rank0["warnings"] if "NVFP4" in w]  # two compressed-tensors exports, one warning
    for needed in ("compressed-tensors", "transformers 5.13", "5.23", "weight_global_scale",
                   "modelopt_moe.export.transformers_compat.fix_nvfp4_experts()"):
        assert needed in warning, (needed, warning)
    assert all(not any("NVFP4" in w for w in r["warnings"]) for r in others)


def test_transformers_with_the_public_fix_gives_the_megatron_models_logits(run):
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from modelopt_moe.export import transformers_compat

    with transformers_compat.fix_nvfp4_experts() as fix:
        assert fix.applied, fix.note
        model = AutoModelForCausalLM.from_pretrained(run["out"] / "nvfp4_ct", dtype=torch.float32,
                                                     quantization_config=CompressedTensorsConfig(dequantize=True))
    with torch.no_grad():
        theirs = model(run["results"][0]["tokens"]).logits.float()
    ours = run["results"][0]["logits"].float()
    per_position = (theirs - ours).abs().amax(-1).flatten()
    close = (per_position <= 5e-3).float().mean().item()
    print(f"NVFP4 compressed-tensors via transformers + transformers_compat fix: logits max diff "
          f"{per_position.max().item():.3g}, {100 * close:.0f}% of positions within 5e-3")
    # compressed-tensors decodes NVFP4 to bf16 weights (1 bf16 ulp from training's fake quant; test_hf_export:
    # 1.2e-3). Measured 31 of 32 positions within 1.9e-3; the last, 1.2e-2, is a token whose router's 2nd and 3rd
    # expert probabilities differ by 4.5e-5, so those ulps pick another expert. Unfixed: 0 of 32, up to 0.94.
    assert close >= 0.9, per_position
    assert per_position.max().item() <= 5e-2, per_position

