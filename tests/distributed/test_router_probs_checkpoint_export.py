"""Checkpoints and export around the down projection's input order, through the public API as a training script
uses it (2 gloo ranks, TP1 x EP2; on CPU the Megatron shims of ``megatron_cpu`` are the only non-public call).

* A checkpoint records that its expert down-projection (``linear_fc2``) input amaxes were calibrated on the
  activation before the router probability: loading one warns nothing. A checkpoint without that record (saved before
  the quantizer moved ahead of the probability; simulated by removing the record from a new one's state file) still
  loads bit-exact, and warns once, on rank 0, naming every such quantizer and saying that ``mtq.calibrate`` fixes it;
  after ``mtq.calibrate`` the amaxes are those of a fresh calibration.
* ``moe_apply_probs_on_input=True`` (the probability on the experts' input: a model the serving engines do not run)
  trains, and Hugging Face export refuses it before writing anything.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from limits import seconds  # noqa: E402

from modelopt_moe.launch import spawn

WORLD = 2
CONVENTION_WARNING = "expert down-projection (linear_fc2) input amaxes were calibrated on the activation times"


def _setup(tp: int, ep: int):
    from megatron.core import parallel_state, tensor_parallel

    from modelopt_moe.plugins.megatron_cpu import apply_cpu_shims

    apply_cpu_shims()  # Megatron on a CPU-only machine (a no-op with CUDA)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)


def _batch(seq=16):
    tokens = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(seq).expand(2, seq)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    return tokens, positions, mask


def _forward_loop(model):
    with torch.no_grad():
        model(*_batch())


def _fc2_input_amax(model) -> dict:
    return {n: b.detach().clone() for n, b in model.state_dict().items()
            if "linear_fc2.input_quantizer" in n and n.endswith("_amax")}


def _messages(caught) -> list[str]:
    return [str(w.message) for w in caught if CONVENTION_WARNING in str(w.message)]


def _rank(rank, world, root: str) -> dict:
    import warnings

    import torch.distributed as dist
    from megatron.core import parallel_state

    import modelopt_moe.quantization as mtq
    from modelopt_moe.export import ExportError, build_megatron_model, export_hf
    from modelopt_moe.plugins.megatron import load_sharded_checkpoint, save_sharded_checkpoint
    from modelopt_moe.quantization.config import preset_path

    root = Path(root)
    config = preset_path("qwen3_moe_tiny.json")
    _setup(tp=1, ep=2)
    res = {}

    def build(**overrides):
        return build_megatron_model(config, params_dtype=torch.float32, **overrides).eval()

    model = mtq.quantize(build(), mtq.load_config("fp8_per_expert.yaml"), _forward_loop)
    saved_amax = _fc2_input_amax(model)
    save_sharded_checkpoint(model, root / "new")
    if rank == 0:  # a checkpoint of before: the same, without the record in its quantization state
        shutil.copytree(root / "new", root / "old")
        state_file, marker = root / "old" / "modelopt_moe_state.pt", root / "old" / "modelopt_moe_complete.json"
        state = torch.load(state_file, weights_only=True)
        for m in state["models"]:
            del m["expert_down_proj_input"]
        torch.save(state, state_file)
        files = json.loads(marker.read_text())
        files["files"]["modelopt_moe_state.pt"] = state_file.stat().st_size
        marker.write_text(json.dumps(files))
    dist.barrier()

    for name in ("new", "old"):
        loaded = build()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            load_sharded_checkpoint(loaded, root / name)
        res[f"{name}_warnings"] = _messages(caught)
        amax = _fc2_input_amax(loaded)
        res[f"{name}_loads_exactly"] = amax.keys() == saved_amax.keys() and all(
            torch.equal(amax[k], saved_amax[k]) for k in amax)
    mtq.calibrate(loaded, forward_loop=_forward_loop)
    recalibrated = _fc2_input_amax(loaded)
    res["recalibrated_equal_fresh"] = all(torch.equal(recalibrated[k], saved_amax[k]) for k in saved_amax)

    # The probability applied to the experts' input (top-1): QAT trains it as Megatron defines it; export refuses.
    on_input = mtq.quantize(build(moe_apply_probs_on_input=True, moe_router_topk=1, moe_router_pre_softmax=True),
                            mtq.load_config("fp8_default.yaml"), _forward_loop)
    with torch.no_grad():
        res["on_input_logits_finite"] = bool(torch.isfinite(on_input(*_batch())).all())
    try:
        export_hf(on_input, root / "on_input", format="compressed-tensors", progress=False)
        res["on_input_export"] = None
    except ExportError as e:
        res["on_input_export"] = str(e)
    res["on_input_written"] = (root / "on_input").exists()
    parallel_state.destroy_model_parallel()
    return res


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn(_rank, WORLD, args=(str(tmp_path_factory.mktemp("router_probs")),), timeout=seconds(900))


def test_new_checkpoints_load_without_a_warning(results):
    for r in results:
        assert r["new_warnings"] == []
        assert r["new_loads_exactly"]


def test_a_checkpoint_of_before_loads_and_warns_once_on_rank0_naming_the_quantizers(results):
    r0 = results[0]
    assert r0["old_loads_exactly"]
    assert len(r0["old_warnings"]) == 1
    message = r0["old_warnings"][0]
    for layer in (0, 1):
        assert f"decoder.layers.{layer}.mlp.experts.linear_fc2.input_quantizer" in message
    assert "linear_fc1" not in message
    assert "mtq.calibrate" in message
    assert all(r["old_warnings"] == [] and r["old_loads_exactly"] for r in results[1:])


def test_calibrate_gives_the_amax_of_a_fresh_calibration(results):
    assert all(r["recalibrated_equal_fresh"] for r in results)


def test_probs_on_input_trains_and_export_refuses_it_before_writing(results):
    for r in results:
        assert r["on_input_logits_finite"]
        assert r["on_input_export"] is not None
        assert "moe_apply_probs_on_input=True" in r["on_input_export"]
        assert not r["on_input_written"]
