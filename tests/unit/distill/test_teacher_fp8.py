"""The teacher's weights in FP8: real E4M3 codes and scales, read back dequantized wherever the model reads them."""

import copy
import pickle

import pytest
import torch

from modelopt_moe.distill import DistillationModel, QADRecipe, store_weights_fp8
from modelopt_moe.distill.teacher_fp8 import stored_bytes
from modelopt_moe.numerics.formats import fake_quant


class TiedLM(torch.nn.Module):
    """Embedding, two linears, a norm, and an output that reads the embedding's table in the parent's forward."""

    def __init__(self, vocab=96, hidden=48):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, hidden)
        self.fc1, self.fc2 = torch.nn.Linear(hidden, 2 * hidden), torch.nn.Linear(2 * hidden, hidden)
        self.norm = torch.nn.LayerNorm(hidden)

    def forward(self, tokens):
        x = self.embedding(tokens)
        x = x + self.fc2(torch.nn.functional.silu(self.fc1(x)))
        return self.norm(x) @ self.embedding.weight.t()


def _model(dtype=torch.bfloat16):
    torch.manual_seed(0)
    return TiedLM().to(dtype)


def _fake_quantized(model, granularity):
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        if p.dim() == 2:
            amax = p.float().abs().amax() if granularity == "per_tensor" else p.float().abs().amax(-1, keepdim=True)
            p.data = fake_quant(p.data, "e4m3", amax)
    return ref


TOKENS = torch.randint(0, 96, (3, 10), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_teacher_is_the_fake_quantized_teacher_at_half_the_bytes(granularity, dtype):
    model = _model(dtype)
    reference, before = _fake_quantized(model, granularity), stored_bytes(model)
    teacher = copy.deepcopy(model)
    stats = store_weights_fp8(teacher, granularity)
    assert stats["converted"] == 3  # embedding (tied output), fc1, fc2; the norm stays
    assert {b.dtype for n, b in teacher.named_buffers() if n.endswith("_fp8")} == {torch.float8_e4m3fn}
    assert [n for n, p in teacher.named_parameters() if p.dim() == 2] == []
    with torch.no_grad():
        out, ref, full = teacher(TOKENS), reference(TOKENS), model(TOKENS)
    assert out.dtype == dtype
    assert torch.equal(out, ref)  # bit for bit the FP8 fake-quantized weights
    ratio = stored_bytes(teacher) / before
    assert ratio < (0.56 if dtype == torch.bfloat16 else 0.28), ratio  # 1 byte an element + scales
    assert (out - full).float().pow(2).mean().sqrt() < 0.1 * full.float().std()
    assert teacher.fc1.weight.dtype == dtype  # read back in the weight's own dtype


def test_distillation_model_stores_the_teacher_in_fp8_and_trains_the_student():
    student, teacher = _model(), _model()
    model = DistillationModel(student, teacher, teacher_fp8="per_channel")
    assert isinstance(model.teacher.fc1.weight_fp8, torch.Tensor)
    assert not any(p.dim() == 2 for p in model.teacher.parameters())
    loss = model(TOKENS).mean()
    loss.backward()
    assert all(p.grad is not None for p in student.parameters() if p.dim() == 2)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # the student's alone: the teacher is no child
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):  # both, like any DistillationModel
        assert type(clone.teacher.fc1) is type(model.teacher.fc1)
        assert torch.equal(clone.teacher.fc1.weight, model.teacher.fc1.weight)
        assert clone.teacher.fc1.weight_fp8.data_ptr() != model.teacher.fc1.weight_fp8.data_ptr()


def test_distillation_model_refuses_an_unknown_granularity_before_touching_the_teacher():
    teacher = _model().train()
    with pytest.raises(ValueError, match=r"teacher_fp8='e4m3'; expected None or one of \['per_tensor', 'per_chan"):
        DistillationModel(_model(), teacher, teacher_fp8="e4m3")
    assert teacher.training
    assert type(teacher.fc1) is torch.nn.Linear


def test_recipe_opts_in_and_checks_the_value():
    assert QADRecipe().teacher_fp8 is None  # off by default
    assert QADRecipe(teacher_fp8="per_tensor").to_dict()["teacher_fp8"] == "per_tensor"
    with pytest.raises(ValueError, match=r"QADRecipe.teacher_fp8='fp8'.*per_tensor.*per_channel"):
        QADRecipe(teacher_fp8="fp8")


def test_bad_weight_or_granularity_is_refused_before_anything_changes():
    model = _model()
    model.fc2.weight.data[0, 0] = float("nan")
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"fc2\.weight"):
        store_weights_fp8(model)
    assert type(model.fc1) is torch.nn.Linear  # fc1 (before fc2) not converted either
    assert all(torch.equal(v, state[k]) or v.isnan().any() for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match=r"granularity='per_block'.*per_tensor"):
        store_weights_fp8(_model(), "per_block")


def test_transformer_engine_modules_are_refused_by_name():
    # Transformer Engine does not install here: a module of its package stands for one (TE reads its weights itself)
    te_linear = type("Linear", (torch.nn.Linear,), {"__module__": "transformer_engine.pytorch.module.linear"})
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), te_linear(8, 8))
    with pytest.raises(ValueError, match=r"store_weights_fp8: 1 is a Transformer Engine module \(Linear\)"):
        store_weights_fp8(model)
    assert type(model[0]) is torch.nn.Linear  # nothing changed


def test_a_weight_shared_by_two_modules_is_stored_once():
    torch.manual_seed(0)
    embedding, head = torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64, bias=False)
    head.weight = embedding.weight  # tied, as a Hugging Face LM head
    model = torch.nn.Sequential(embedding, head).bfloat16()
    reference, before = _fake_quantized(model, "per_channel"), stored_bytes(model)
    stats = store_weights_fp8(model, "per_channel")
    assert stats["converted"] == 2
    assert model[0].weight_fp8 is model[1].weight_fp8  # one copy of the codes
    assert stored_bytes(model) < 0.6 * before
    tokens = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        assert torch.equal(model(tokens), reference(tokens))
