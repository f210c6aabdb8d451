"""Framework-free checkpoint parts: canonical expert amax, plain save/restore across layouts, directory checks."""

import itertools

import pytest
import torch
from torch import nn

import modelopt_moe.quantization as mtq
from modelopt_moe.checkpoint import (
    CheckpointMismatchError,
    IncompleteCheckpointError,
    canonical_amax,
    check_checkpoint_dir,
    iter_expert_slots,
    native_from_canonical,
    restore,
    save,
)
from modelopt_moe.checkpoint.amax import classify_checkpoint_amax
from modelopt_moe.quantization.nn.grouped_linear import GroupedLinear

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
    x = torch.randn(8, 16)
    return mtq.quantize(Tiny(), cfg, lambda m: m(x)), x


def _expert_amax(model):
    return {s.name: [s.layout.expert_amax(i).reshape(()) for i in range(s.num_local)] for s in iter_expert_slots(model)
            if s.kind != "output_quantizer"}


@pytest.mark.parametrize("src,dst", list(itertools.product(LAYOUTS, LAYOUTS)))
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


def test_canonical_round_trip_and_shared_takes_the_max():
    model, _ = _quantized("vectorized")
    slot = next(s for s in iter_expert_slots(model) if s.kind == "weight_quantizer")
    canon = canonical_amax(slot.layout, N, ())
    assert canon.shape == (N,) and len(set(canon.tolist())) == N
    shared, _ = _quantized("shared")
    sslot = next(s for s in iter_expert_slots(shared) if s.kind == "weight_quantizer")
    assert torch.equal(native_from_canonical(sslot.layout, canon)["_amax"], canon.max())
    per, _ = _quantized("per_expert")
    pslot = next(s for s in iter_expert_slots(per) if s.kind == "weight_quantizer")
    assert [v.item() for v in native_from_canonical(pslot.layout, canon).values()] == canon.tolist()


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
