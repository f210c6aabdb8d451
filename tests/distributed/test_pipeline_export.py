"""Pipeline parallelism beyond training, as a user's script does it: public API only (``transformers``, Megatron-Core's
own parallel state and schedule, ``modelopt_moe.launch.spawn``, ``modelopt_moe.export``, ``mtq``,
``modelopt_moe.checkpoint``, ``modelopt_moe.plugins.megatron``; on this CPU machine also the CPU shims).

One spawn of 4 gloo ranks, at PP=2 x TP=2 x EP=2 and then PP=1 x TP=2 x EP=2, on the same transformers-written
Qwen3-MoE checkpoint (``import_hf``) and the same calibration tokens (Megatron's pipeline schedule, forward only):

* ``export_hf`` writes one checkpoint per format (``hf`` of the imported model; ``compressed-tensors`` and
  ``modelopt`` once quantized to NVFP4 with an FP8 KV cache), and the PP=2 files are the PP=1 files byte for byte
  (every stage's layers and KV-cache scales under their global numbers); with tied embeddings too, whose last-stage
  copy ``import_hf`` loads; the export of an uncalibrated model fails with the same error on every rank, writing
  nothing;
* ``print_quant_summary(gather=True)`` at PP=2 names every quantizer of every stage once, under its global layer
  name: the same lines as at PP=1;
* ``restore_sharded_modelopt_state`` called directly at PP=2 on a checkpoint saved at PP=2 restores each stage's
  quantizers (then Megatron's own ``dist_checkpointing.load``): the export of the restored model is the same bytes;
* at virtual pipeline size 2 (Megatron's interleaved schedule: two model chunks per stage, built by
  ``build_megatron_model(..., vp_stage=...)``), the chunks loaded from the PP=2 checkpoint export the PP=1 files byte
  for byte; ``import_hf(chunks, hf_dir)`` loads every parameter of every chunk as the PP=1 import does (compared per
  global layer and parallel rank), tied embeddings' last-chunk copy included, and the imported chunks export the
  PP=1 files; a checkpoint with one tensor of a wrong shape in a layer of the second chunks changes no chunk (the
  first ones included) and names the tensor; import, QAD and ``setup_training`` given a model built without
  ``vp_stage`` (not a stage's list of chunks), and import given the chunks out of order, refuse, naming the setting,
  before they write anything.
"""

import json
from pathlib import Path

import pytest
import torch
from limits import seconds  # noqa: E402
from megatron_harness.ranks import errors_of, merged_across_ranks  # noqa: E402

from modelopt_moe.launch import spawn

WORLD, TP, EP, SEQ = 4, 2, 2, 16
FORMATS = ("hf", "compressed-tensors", "modelopt", "tied")  # tied: the hf export of a model with tied embeddings
BAD_TENSOR = "model.layers.2.self_attn.o_proj.weight"  # layer 2: the second chunk of stage 0 at PP=2 x VPP=2


def _save_qwen3_moe(path: Path, tied: bool = False) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32, max_position_embeddings=64, tie_word_embeddings=tied)
    Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def _save_with_a_wrong_shape(src: Path, path: Path) -> None:
    """A copy of the checkpoint ``src`` whose ``BAD_TENSOR`` lost its last column."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, path)
    tensors = load_file(path / "model.safetensors")
    tensors[BAD_TENSOR] = tensors[BAD_TENSOR][:, :-1].contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _params(chunks) -> dict:
    """Every parameter of this rank's model chunks by (global name, the tensor- or expert-parallel rank whose slice
    it is): the same keys at any pipeline layout of the same TP and EP."""
    import re

    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    tp, ep = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_expert_model_parallel_rank()
    out = {}
    for chunk in chunks:
        offset = get_transformer_layer_offset(chunk.config, vp_stage=getattr(chunk, "vp_stage", None)) if pp > 1 else 0
        for name, p in chunk.named_parameters():
            layer = re.match(r"decoder\.layers\.(\d+)\.", name)
            if layer is not None:
                name = f"decoder.layers.{int(layer.group(1)) + offset}.{name[layer.end():]}"
            out[(name, f"ep{ep}" if ".experts." in name else f"tp{tp}")] = p.detach().clone()
    return out


def _tied_copy(output_weight: torch.Tensor, tied_dir: str) -> bool:
    """Whether this rank's output layer (the last stage's copy of a tied embedding) holds its rows of the embedding."""
    from megatron.core import parallel_state
    from safetensors import safe_open

    with safe_open(f"{tied_dir}/model.safetensors", "pt") as f:
        rows = f.get_tensor("model.embed_tokens.weight").chunk(TP)
    embedding = rows[parallel_state.get_tensor_model_parallel_rank()]
    return torch.equal(output_weight, embedding.to(output_weight.dtype))


def _batches(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, 128, (2, SEQ), generator=g)
        out.append({"tokens": tokens, "labels": tokens.roll(-1, 1), "position_ids": torch.arange(SEQ).expand(2, SEQ),
                    "attention_mask": None})
    return out


def _layout(pp: int, hf_dir: str, out: Path) -> dict:
    import io

    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    import modelopt_moe.quantization as mtq
    from modelopt_moe.checkpoint import restore_sharded_modelopt_state
    from modelopt_moe.export import build_megatron_model, export_hf, import_hf
    from modelopt_moe.plugins.megatron import lm_forward_step, model_sharded_state_dict, save_sharded_checkpoint
    from modelopt_moe.plugins.megatron_cpu import megatron_training_shims

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP, expert_model_parallel_size=EP,
                                             expert_tensor_parallel_size=1,
                                             pipeline_model_parallel_size=pp)
    tensor_parallel.model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)

    def build(path=hf_dir):
        model = build_megatron_model(path, params_dtype=torch.bfloat16)
        import_hf(model, path)
        return model.eval()

    def forward_loop(m):
        with megatron_training_shims(), torch.no_grad():
            get_forward_backward_func()(forward_step_func=lm_forward_step, data_iterator=iter(_batches(2)),
                                        model=[m], num_microbatches=2, seq_length=SEQ, micro_batch_size=2,
                                        forward_only=True)

    tied_dir = str(Path(hf_dir).parent / "tied")
    tied = build(tied_dir)  # tied embeddings: the last stage holds its own copy of the embedding as output layer
    export_hf(tied, out / f"pp{pp}" / "tied", format="hf", progress=False)
    tied_copy = None
    if pp > 1 and parallel_state.is_pipeline_last_stage():
        tied_copy = _tied_copy(tied.output_layer.weight, tied_dir)
    model = build()
    imported = _params([model]) if pp == 1 else None
    export_hf(model, out / f"pp{pp}" / "hf", format="hf", progress=False)  # the imported bf16 model
    config = dict(mtq.NVFP4_DEFAULT_CFG)  # with an FP8 KV cache, as Model Optimizer users merge the presets
    config["quant_cfg"] = config["quant_cfg"] + mtq.FP8_KV_CFG["quant_cfg"]
    mtq.quantize(model, config, forward_loop)
    for fmt in ("compressed-tensors", "modelopt"):
        export_hf(model, out / f"pp{pp}" / fmt, format=fmt, progress=False)
    summary = mtq.print_quant_summary(model, file=io.StringIO(), gather=True)
    result = {"summary": summary, "layers": len(model.decoder.layers), "tied_copy": tied_copy, "params": imported}
    if pp > 1:  # saved at PP=2, restored into a fresh PP=2 model by the user's own calls
        save_sharded_checkpoint(model, out / "ckpt")
        uncalibrated = mtq.quantize(build(), config)  # no forward loop: no amax on any stage
        try:
            export_hf(uncalibrated, out / "uncalibrated", progress=False)
            result["uncalibrated"] = None
        except Exception as e:  # noqa: BLE001  (the test names any other kind)
            result["uncalibrated"] = f"{type(e).__name__}: {e}"
        fresh = build()
        restore_sharded_modelopt_state([fresh], out / "ckpt")
        state = model_sharded_state_dict(fresh)
        fresh.load_state_dict(dist_checkpointing.load(state, str(out / "ckpt"))["model"])
        export_hf(fresh, out / "restored" / "modelopt", format="modelopt", progress=False)
    return result, model


def _virtual_pipeline_export(hf_dir: str, out: Path) -> dict:
    """At TP=2 x EP=2 x PP=2 x VPP=2: the model chunks restored from the PP=2 checkpoint, exported."""
    from megatron.core import parallel_state, tensor_parallel

    from modelopt_moe.export import build_megatron_model, export_hf
    from modelopt_moe.plugins.megatron import load_sharded_checkpoint

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP, expert_model_parallel_size=EP,
                                             expert_tensor_parallel_size=1, pipeline_model_parallel_size=2,
                                             virtual_pipeline_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)
    try:
        build_megatron_model(hf_dir, params_dtype=torch.bfloat16)
        no_vp_stage = None
    except Exception as e:  # noqa: BLE001  (the test names any other kind)
        no_vp_stage = f"{type(e).__name__}: {e}"
    chunks = [build_megatron_model(hf_dir, params_dtype=torch.bfloat16, vp_stage=v) for v in range(2)]
    load_sharded_checkpoint(chunks, out / "ckpt")
    for fmt in ("compressed-tensors", "modelopt"):
        export_hf(chunks, out / "vpp" / fmt, format=fmt, progress=False)
    return {"layers": [len(c.decoder.layers) for c in chunks], "no_vp_stage": no_vp_stage}


def _virtual_pipeline_import(hf_dir: str, out: Path) -> dict:
    """At TP=2 x EP=2 x PP=2 x VPP=2 (the parallel state :func:`_virtual_pipeline_export` leaves): ``import_hf`` of a
    checkpoint with a tensor of a wrong shape into fresh chunks, then of the checkpoint itself, exported; the same
    with tied embeddings."""
    from megatron.core import parallel_state

    from modelopt_moe.export import build_megatron_model, export_hf, import_hf

    base = Path(hf_dir).parent

    def build(path):
        return [build_megatron_model(path, params_dtype=torch.bfloat16, vp_stage=v) for v in range(2)]

    chunks = build(hf_dir)
    before = [{n: p.detach().clone() for n, p in c.named_parameters()} for c in chunks]
    try:
        import_hf(chunks, str(base / "bad"))
        bad = None
    except Exception as e:  # noqa: BLE001  (the test names any other kind)
        bad = f"{type(e).__name__}: {e}"
    unchanged = [all(torch.equal(p, was[n]) for n, p in c.named_parameters())
                 for c, was in zip(chunks, before, strict=True)]
    try:
        import_hf(chunks[::-1], hf_dir)
        reversed_chunks = None
    except Exception as e:  # noqa: BLE001  (the test names any other kind)
        reversed_chunks = f"{type(e).__name__}: {e}"
    import_hf(chunks, hf_dir)
    export_hf(chunks, out / "vpp_import" / "hf", format="hf", progress=False)
    tied_dir = str(base / "tied")
    tied = build(tied_dir)
    try:  # a second chunk built from another config (tied embeddings) beside a first chunk of this one
        import_hf([chunks[0], tied[1]], hf_dir)
        mixed = None
    except Exception as e:  # noqa: BLE001  (the test names any other kind)
        mixed = f"{type(e).__name__}: {e}"
    import_hf(tied, tied_dir)
    export_hf(tied, out / "vpp_import" / "tied", format="hf", progress=False)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=1)
    return {"bad": bad, "unchanged": unchanged, "reversed": reversed_chunks, "mixed": mixed, "params": _params(chunks),
            "tied_copy": _tied_copy(tied[1].output_layer.weight, tied_dir) if last else None}


def _virtual_pipeline_refusals(model, hf_dir: str, out: Path) -> dict:
    """Every entry point given one model (not a stage's list of chunks) at virtual pipeline size 2: the error it
    raises.

    Quantization, the interleaved schedule and checkpoints of model chunks: test_virtual_pipeline.py.
    """
    from megatron.core import parallel_state

    from modelopt_moe.export import import_hf
    from modelopt_moe.plugins.megatron import distillation_model
    from modelopt_moe.plugins.megatron.training import setup_training

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP, pipeline_model_parallel_size=2,
                                             virtual_pipeline_model_parallel_size=2, expert_tensor_parallel_size=1)
    calls = {
        "import_hf": lambda: import_hf(model, hf_dir),
        "distillation_model": lambda: distillation_model(model, model),
        "setup_training": lambda: setup_training(model),
    }
    errors = errors_of(calls)
    parallel_state.destroy_model_parallel()
    return errors


def _user_script(rank, world_size, hf_dir, out_dir):
    from modelopt_moe.plugins.megatron_cpu import apply_cpu_shims  # CPU only: Megatron needs CUDA otherwise

    apply_cpu_shims()
    out = Path(out_dir)
    pp2, _ = _layout(2, hf_dir, out)
    pp1, model = _layout(1, hf_dir, out)
    vpp = _virtual_pipeline_export(hf_dir, out)
    vpp_import = _virtual_pipeline_import(hf_dir, out)
    return {"pp2": pp2, "pp1": pp1, "vpp": vpp, "vpp_import": vpp_import,
            "virtual": _virtual_pipeline_refusals(model, hf_dir, out)}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("pp_export")
    _save_qwen3_moe(base / "qwen3_moe")
    _save_qwen3_moe(base / "tied", tied=True)
    _save_with_a_wrong_shape(base / "qwen3_moe", base / "bad")
    (base / "out").mkdir()
    results = spawn(_user_script, WORLD, args=(str(base / "qwen3_moe"), str(base / "out")), timeout=seconds(900))
    return {"results": results, "out": base / "out"}


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_at_pp2_is_the_pp1_export_byte_for_byte(run, fmt):
    assert all(r["pp2"]["layers"] == 2 for r in run["results"])  # 4 layers on 2 stages
    pp1, pp2 = _files(run["out"] / "pp1" / fmt), _files(run["out"] / "pp2" / fmt)
    assert sorted(pp2) == sorted(pp1)
    assert any(n.endswith(".safetensors") for n in pp1)
    for name in pp1:
        assert pp2[name] == pp1[name], name
    config = json.loads(pp1["config.json"])
    assert config["num_hidden_layers"] == 4
    if fmt not in ("hf", "tied"):
        assert "quantization_config" in config
    assert config["tie_word_embeddings"] == (fmt == "tied")


def test_import_at_pp2_loads_the_last_stages_copy_of_tied_embeddings(run):
    copies = [r["pp2"]["tied_copy"] for r in run["results"]]
    assert copies.count(True) == 2  # the last stage's two TP ranks
    assert copies.count(None) == 2  # the first stage holds the embedding itself


def test_export_at_pp2_holds_every_layer_once(run):
    from safetensors import safe_open

    path = run["out"] / "pp2" / "modelopt"
    names = set()
    for shard in path.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            names.update(f.keys())
    layers = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
    assert layers == {0, 1, 2, 3}
    assert "lm_head.weight" in names
    assert "model.embed_tokens.weight" in names
    assert any(".mlp.experts.3." in n for n in names)  # every EP rank's experts
    assert {n for n in names if n.endswith("_proj.k_scale")} == {f"model.layers.{L}.self_attn.k_proj.k_scale"
                                                                 for L in range(4)}  # every stage's KV-cache scales


def test_quant_summary_gathered_at_pp2_names_every_layer_once_as_pp1(run):
    for r in run["results"]:
        pp1, pp2 = r["pp1"]["summary"].splitlines(), r["pp2"]["summary"].splitlines()
        quantizer_lines = [line for line in pp2 if line.startswith("decoder.layers.")]
        names = [line.split()[0] for line in quantizer_lines]
        assert len(names) == len(set(names)), "a layer name appears twice"
        assert any(n.startswith("decoder.layers.3.") for n in names)
        assert pp2 == pp1


def test_restore_sharded_modelopt_state_at_pp2_then_export_is_the_same(run):
    assert _files(run["out"] / "restored" / "modelopt") == _files(run["out"] / "pp2" / "modelopt")


def test_one_model_at_virtual_pipeline_stages_is_refused_by_name_everywhere(run):
    for r in run["results"]:
        for call, error in r["virtual"].items():
            assert error is not None, f"{call} accepted one model at virtual pipeline stages"
            assert error.startswith(("ValueError", "ExportError")), error
            assert "virtual_pipeline_model_parallel_size=2" in error, error
            assert "expected None or 1" in error, error
        assert "pass the list of the 2 chunks built with vp_stage=0..1" in r["virtual"]["import_hf"]


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_export_of_virtual_pipeline_chunks_is_the_pp1_export_byte_for_byte(run, fmt):
    for r in run["results"]:
        assert r["vpp"]["layers"] == [1, 1]  # 4 layers on 2 stages x 2 chunks
        assert "vp_stage=None with virtual_pipeline_model_parallel_size=2" in r["vpp"]["no_vp_stage"]
    pp1, vpp = _files(run["out"] / "pp1" / fmt), _files(run["out"] / "vpp" / fmt)
    assert sorted(vpp) == sorted(pp1)
    for name in pp1:
        assert vpp[name] == pp1[name], name


def _merged(results, key: str) -> dict:
    """The ranks' ``_params`` of one layout as one dict (the ranks that hold the same slice hold the same bits)."""
    return merged_across_ranks(r[key]["params"] for r in results)


def test_import_into_virtual_pipeline_chunks_is_the_pp1_import(run):
    pp1, vpp = _merged(run["results"], "pp1"), _merged(run["results"], "vpp_import")
    assert sorted(vpp) == sorted(pp1)
    names = {name for name, _ in pp1}
    assert {"embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"} <= names
    assert {int(n.split(".")[2]) for n in names if n.startswith("decoder.layers.")} == {0, 1, 2, 3}
    for k, t in pp1.items():
        assert vpp[k].dtype == t.dtype, k
        assert torch.equal(vpp[k], t), k


@pytest.mark.parametrize("fmt", ["hf", "tied"])
def test_export_of_chunks_imported_at_virtual_pipeline_stages_is_the_pp1_export_byte_for_byte(run, fmt):
    pp1, vpp = _files(run["out"] / "pp1" / fmt), _files(run["out"] / "vpp_import" / fmt)
    assert sorted(vpp) == sorted(pp1)
    for name in pp1:
        assert vpp[name] == pp1[name], name


def test_import_at_virtual_pipeline_stages_loads_the_last_chunks_copy_of_tied_embeddings(run):
    copies = [r["vpp_import"]["tied_copy"] for r in run["results"]]
    assert copies.count(True) == 2  # the last stage's two TP ranks, in their second chunk
    assert copies.count(None) == 2


def test_import_into_chunks_of_a_wrong_shape_in_the_second_chunk_changes_no_chunk_and_names_the_tensor(run):
    for r in run["results"]:
        error = r["vpp_import"]["bad"]
        assert error is not None
        assert error.startswith("ExportError: "), error
        assert f"tensor {BAD_TENSOR} has shape [64, 63], expected [64, 64]" in error, error
        assert r["vpp_import"]["unchanged"] == [True, True]  # the first chunk too: nothing written before the check


def test_import_of_chunks_out_of_vp_stage_order_or_of_another_config_is_refused_by_name(run):
    for r in run["results"]:
        assert r["vpp_import"]["reversed"] == ("ExportError: import_hf: model chunk 0 has vp_stage=1, expected 0 "
                                               "(the chunks in the order of their virtual pipeline stages)")
        mixed = r["vpp_import"]["mixed"]
        assert mixed is not None, "a chunk built from another config was imported"
        assert mixed.startswith("ExportError: "), mixed
        assert "config.json (model chunk 1) does not match the Megatron model: tie_word_embeddings: " in mixed, mixed


def test_export_at_pp2_of_an_uncalibrated_model_fails_the_same_on_every_rank_before_writing(run):
    errors = {r["pp2"]["uncalibrated"] for r in run["results"]}
    assert len(errors) == 1, errors  # every rank raises, and the same error: no rank waits in a collective
    error = errors.pop()
    assert error is not None
    assert error.startswith("ExportError: "), error
    assert "layer 0" in error or "layers.0." in error, error  # the first stage's first layer, by its global number
    assert "calibrate" in error, error
    assert not (run["out"] / "uncalibrated").exists()
