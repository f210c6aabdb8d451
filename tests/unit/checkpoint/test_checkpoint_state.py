"""Framework-free checkpoint parts: the [N] expert amax in every layout, plain save/restore across layouts,
directory checks."""

import itertools

import pytest
import torch
from torch import nn

import modelopt_moe.quantization as mtq
from modelopt_moe.checkpoint import (
    CheckpointMismatchError,
    IncompleteCheckpointError,
    check_checkpoint_dir,
    iter_expert_quantizers,
    restore,
    save,
)
from modelopt_moe.checkpoint.expert_axis import classify_checkpoint_amax
from modelopt_moe.quantization.nn import GroupedLinear

N = 4
LAYOUTS = ("shared", "vectorized", "per_expert")


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(16, 32)
        self.experts = GroupedLinear(N, 32, 16)
        for i in range(N):  # a distinct magnitude per expert, so a wrong expert index cannot pass
            with torch.no_grad():
                getattr(self.experts, f"weight{i}").mul_(i + 1)

    def forward(self, x):
        h = self.proj(x)
        return self.experts(h, [h.shape[0] // N] * N)


def _quantized(weight_amax, input_amax="per_expert"):
    cfg = mtq.load_config("fp8_default.yaml")
    cfg.experts.weight_amax, cfg.experts.input_amax = weight_amax, input_amax
    cfg.weight_amax_update = "static"  # amaxes as saved and restored (a dynamic one is recomputed by the forward)
    x = torch.randn(8, 16)
    return mtq.quantize(Tiny(), cfg, lambda m: m(x)), x


def _expert_amax(model):
    return {e.name: [e.quantizer.expert_amax(i).reshape(()) for i in range(e.gemm.num_local)]
            for e in iter_expert_quantizers(model) if e.kind != "output_quantizer"}


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(LAYOUTS, LAYOUTS)))
def test_plain_save_restore_across_weight_layouts(tmp_path, src, dst):
    model, x = _quantized(src)
    save(model, tmp_path / "m.pt")
    fresh = restore(Tiny(), tmp_path / "m.pt", experts={"weight_amax": dst, "input_amax": "per_expert"})
    want = _expert_amax(model)
    got = _expert_amax(fresh)
    name = "experts.weight_quantizer"
    expect = want[name] if dst != "shared" else [torch.stack(want[name]).max()] * N
    assert all(torch.equal(a, b) for a, b in zip(got[name], expect, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got["experts.input_quantizer"], want["experts.input_quantizer"],
                                                 strict=True))
    if src == dst or src == "shared" or dst != "shared":
        assert torch.equal(fresh(x), model(x))


def test_restore_into_meta_model_assigns(tmp_path):
    model, x = _quantized("per_expert")
    save(model, tmp_path / "m.pt")
    with torch.device("meta"):
        fresh = Tiny()
    restore(fresh, tmp_path / "m.pt")
    assert torch.equal(fresh(x), model(x))


def test_every_layout_holds_one_n_expert_amax_and_shared_holds_the_max():
    vec, _ = _quantized("vectorized")
    amax = vec.experts.weight_quantizer.amax
    assert amax.shape == (N,)
    assert len(set(amax.tolist())) == N
    shared, _ = _quantized("shared")
    assert torch.equal(shared.experts.weight_quantizer.amax, amax.max().expand(N))
    per, _ = _quantized("per_expert")
    q = per.experts.weight_quantizer
    assert torch.equal(q.amax, amax)
    # per_expert presents N views with Model Optimizer's keys; they hold no state of their own
    sd = per.state_dict()
    assert [k for k in sd if k.startswith("experts.weight_quantizer")] == [
        f"experts.weight_quantizer.{i}._amax" for i in range(N)]
    assert [sd[f"experts.weight_quantizer.{i}._amax"].item() for i in range(N)] == amax.tolist()
    q[2].amax = 0.5  # a view writes its row of the one tensor
    assert q.amax[2].item() == 0.5
    assert q.amax.data_ptr() == q._amax.data_ptr()
    assert not list(q[2].buffers())
    assert not list(q[2].parameters())
    assert "experts.weight_quantizer._amax" in vec.state_dict()


def test_classify_checkpoint_amax_messages():
    assert classify_checkpoint_amax("k", (2, 8), (2, 8), 1, "/c") == "match"
    assert classify_checkpoint_amax("k", (2, 8), (2,), 1, "/c") == "legacy"
    with pytest.raises(CheckpointMismatchError, match=r"k: expected 8 experts in checkpoint /c, found 6"):
        classify_checkpoint_amax("k", (2, 8), (2, 6), 1, "/c")
    with pytest.raises(CheckpointMismatchError, match=r"k: amax shape mismatch .* expected global shape \(2, 8, 64\), "
                                                      r"found \(2, 8\)"):
        classify_checkpoint_amax("k", (2, 8, 64), (2, 8), 1, "/c")
    with pytest.raises(CheckpointMismatchError, match="not in checkpoint"):
        classify_checkpoint_amax("k", (2, 8), None, 1, "/c")


def test_wrong_expert_count_in_plain_restore(tmp_path):
    model, _ = _quantized("vectorized")
    save(model, tmp_path / "m.pt")
    other = Tiny()
    other.experts = GroupedLinear(2, 32, 16)
    with pytest.raises(CheckpointMismatchError, match=r"experts\.\w+_quantizer\._amax: expected 2 experts .*found 4"):
        restore(other, tmp_path / "m.pt")


def test_check_checkpoint_dir_names_what_is_missing(tmp_path):
    with pytest.raises(IncompleteCheckpointError, match="does not exist"):
        check_checkpoint_dir(tmp_path / "nope")
    d = tmp_path / "ck.tmp"
    d.mkdir()
    (d / ".metadata").write_text("x")
    with pytest.raises(IncompleteCheckpointError, match=r"ck\.tmp is incomplete.*metadata\.json.*modelopt_moe_state\.pt"
                                                        r".*modelopt_moe_complete\.json"):
        check_checkpoint_dir(d)


def test_states_saved_before_narrow_range_existed_keep_their_int_meaning():
    # Version 2 states had no narrow_range (int was symmetric) and int blocks without a type were dynamic.
    from modelopt_moe.checkpoint import modelopt_state, restore_modelopt_state

    cfg = {"quant_cfg": [{"quantizer_name": "*weight_quantizer",
                          "cfg": {"num_bits": 4, "block_sizes": {-1: 16, "type": "dynamic"}}},
                         {"quantizer_name": "*input_quantizer", "cfg": {"num_bits": 8}}]}
    model = mtq.quantize(Tiny(), cfg, lambda m: m(torch.randn(8, 16)))
    state = modelopt_state(model)
    old = {**state, "version": 2, "quantizers": {
        name: {**e, "cfg": {k: v for k, v in e["cfg"].items() if k not in ("narrow_range", "type")} | (
            {"block_sizes": {-1: 16}} if e["cfg"]["block_sizes"] else {})}
        for name, e in state["quantizers"].items()}}
    fresh = restore_modelopt_state(Tiny(), old)
    assert fresh.proj.input_quantizer.narrow_range
    assert fresh.proj.weight_quantizer.narrow_range
    assert fresh.proj.weight_quantizer.block_size == 16  # dynamic, as it meant then
    assert not model.proj.input_quantizer.narrow_range  # today's default: Model Optimizer's


def test_the_fake_quant_kernel_and_the_gemm_travel_in_the_state_and_older_readers_see_one_kernel():
    from modelopt_moe.checkpoint import modelopt_state, restore_modelopt_state

    cfg = mtq.load_config("fp8_default")
    cfg.gemm, cfg.kernel = "te_fp8", "torch"
    model = mtq.quantize(Tiny(), cfg, lambda m: m(torch.randn(8, 16)))
    state = modelopt_state(model)
    assert state["kernel"] == "te_fp8"  # the one value versions before the split read
    fresh = restore_modelopt_state(Tiny(), state)
    assert (fresh.experts.quant_kernel, fresh.experts.quant_gemm) == ("torch", "te_fp8")
    # A state saved before the split: kernel te_fp8 meant real FP8 GEMMs with the "auto" fake quant.
    before = restore_modelopt_state(Tiny(), {k: v for k, v in state.items() if k not in ("fake_quant_kernel", "gemm")})
    assert (before.experts.quant_kernel, before.experts.quant_gemm) == ("auto", "te_fp8")
    plain = modelopt_state(mtq.quantize(Tiny(), {**mtq.FP8_DEFAULT_CFG, "kernel": "triton"},
                                        lambda m: m(torch.randn(8, 16))))
    assert (plain["kernel"], plain["fake_quant_kernel"], plain["gemm"]) == ("triton", "triton", "fake_quant")


def test_a_megatron_lm_save_directory_stands_for_its_latest_iteration(tmp_path):
    from modelopt_moe.checkpoint import megatron_lm_iteration_dir

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("120\n")
    assert megatron_lm_iteration_dir(tmp_path) == tmp_path / "iter_0000120"
    with pytest.raises(IncompleteCheckpointError, match="iter_0000120 does not exist"):
        check_checkpoint_dir(tmp_path)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    assert megatron_lm_iteration_dir(tmp_path) == tmp_path / "release"
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("soon")
    with pytest.raises(IncompleteCheckpointError, match="latest_checkpointed_iteration.txt: expected an iteration "
                                                        "number or 'release', found 'soon'"):
        megatron_lm_iteration_dir(tmp_path)
    assert megatron_lm_iteration_dir(tmp_path / "iter_0000120") == tmp_path / "iter_0000120"  # no tracker: as given
    from modelopt_moe.checkpoint import has_sharded_modelopt_state

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    assert not has_sharded_modelopt_state(tmp_path)
    (tmp_path / "iter_0000007").mkdir()
    (tmp_path / "iter_0000007" / "modelopt_moe_state.pt").write_bytes(b"")
    assert has_sharded_modelopt_state(tmp_path)
    assert has_sharded_modelopt_state(tmp_path / "iter_0000007")
