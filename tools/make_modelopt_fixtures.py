r"""Make the Model Optimizer 0.47 fixtures in ``tests/fixtures/modelopt_0_47/`` (run once; the outputs are committed).

The tests compare this package against what NVIDIA Model Optimizer itself produced, without Model Optimizer
installed. Run from the repository root in a separate, test-only environment (Model Optimizer is no dependency of
the library)::

    python3 -m venv .venv-modelopt
    .venv-modelopt/bin/pip install torch==2.13.0
    echo torch==2.13.0 > .venv-modelopt/constraints.txt
    .venv-modelopt/bin/pip install -c .venv-modelopt/constraints.txt nvidia-modelopt==0.47.0 requests \
        huggingface_hub "packaging>=24.2" psutil numpy pyyaml triton==3.9.0
    .venv-modelopt/bin/pip install --no-deps --ignore-requires-python megatron-core==0.19.2
    .venv-modelopt/bin/pip install --no-deps --no-build-isolation -e .
    .venv-modelopt/bin/python tools/make_modelopt_fixtures.py [--out DIR]

The Megatron model is the tests' own (``tests/megatron_harness``), so that the tests rebuild exactly the model the
fixture was saved from.

Files (all CPU, fp32 unless named):

* ``linear_cases.pt.xz``: an ``nn.Sequential`` of three ``nn.Linear`` (128 -> 32 -> 16 -> 8; the last one 16 wide,
  so INT4 blocks of 128 are padded) quantized by ``mtq.quantize`` with Model Optimizer's presets and hand-written
  configs; per case the config dict as given, the calibrated ``*_amax`` tensors, the ``fc1`` input quantizer's
  output on 120 x 128 test activations (15,360 elements, larger than the calibration data so that values clip on
  both sides), every enabled weight quantizer's output (both as distinct values + an index per element: lossless,
  see :func:`pack`), the model output, the state of each quantizer (``get_modelopt_state``) and, for three cases,
  the file ``mto.save`` writes. The inputs and weights are stored once; the file is xz-compressed.
* ``presets.pt``: Model Optimizer's preset dicts (``mtq.FP8_DEFAULT_CFG`` ...), as users pass them.
* ``megatron_moe_fp8_tp1ep2/``: a 2-layer Megatron-Core MoE GPT (4 ``SequentialMLP`` experts) quantized with
  ``FP8_DEFAULT_CFG`` by Model Optimizer on 2 gloo ranks (TP1, EP2) and saved as Model Optimizer documents for
  Megatron: ``dist_checkpointing.save(model.sharded_state_dict())`` and ``save_sharded_modelopt_state``
  (``modelopt_state/`` inside). Beside it ``megatron_moe_fp8_tp1ep2.amax.pt``: every amax by its quantizer's name
  with GLOBAL expert indices, and the full-vocabulary logits of an evaluation batch.

* ``mx.pt.xz``: Model Optimizer's MX presets (``MXFP4_DEFAULT_CFG``, ``MXFP8_DEFAULT_CFG``), the state of its
  TensorQuantizer for each (``get_modelopt_state``), and its CPU MX exporters' E8M0 scales and values
  (``MXFP4QTensor``, ``MXFP8QTensor``) of a 64 x 256 fp32 tensor of spread magnitudes.

Model Optimizer 0.47's NVFP4, MX and dynamic-block fake quant need CUDA, so no NVFP4 or MX fake-quant case is made on
CPU (tests/gpu/test_mx_gpu.py compares against its MX fake quant on the GPU).
"""

from __future__ import annotations

import argparse
import copy
import io
import lzma
import os
import re
import shutil
import sys
import warnings
from collections import OrderedDict
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the Megatron test model (tests/megatron_harness) is not in the package

OUT = ROOT / "tests" / "fixtures" / "modelopt_0_47"

# ---------------------------------------------------------------------------------------------------------------
# nn.Linear cases


def _bf16_exact(t: torch.Tensor) -> torch.Tensor:
    """fp32 values that bf16 holds exactly: the same numbers feed the fp32 and the bf16 cases."""
    return t.to(torch.bfloat16).float()


def linear_model() -> nn.Sequential:
    """The fixed three-linear model of the linear cases (bf16-exact weights, a few large ones)."""
    g = torch.Generator().manual_seed(20261124)
    model = nn.Sequential(OrderedDict(fc1=nn.Linear(128, 32), act1=nn.ReLU(), fc2=nn.Linear(32, 16), act2=nn.ReLU(),
                                      fc3=nn.Linear(16, 8)))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(_bf16_exact(torch.randn(p.shape, generator=g) * (0.1 if p.dim() > 1 else 0.02)))
        # A few large weights so that per-channel and per-block amaxes differ a lot.
        model.fc1.weight[3, 7] = 1.5
        model.fc1.weight[17, 100] = -2.0
    return model


def linear_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """The calibration batch and the test batch (1.6 times the calibration spread) of the linear cases."""
    g = torch.Generator().manual_seed(7)
    calib = _bf16_exact(torch.randn(64, 128, generator=g))
    # Test activations 1.6x the calibration spread: values beyond the calibrated amax on both sides.
    test = _bf16_exact(torch.randn(120, 128, generator=g) * 1.6)
    return calib, test


def pack(t: torch.Tensor | None) -> dict | None:
    """A fake-quantized tensor stored losslessly and small: its distinct bit patterns (as values) and, per element,
    the index of its value (a quantized tensor has few distinct values). ``values[index]`` is ``t`` bit for bit."""
    if t is None:
        return None
    bits = t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)
    uniq, index = torch.unique(bits, return_inverse=True)
    dtype = torch.uint8 if uniq.numel() <= 256 else torch.int16 if uniq.numel() <= 32767 else torch.int32
    return {"values": uniq.view(t.dtype), "index": index.to(dtype)}


def linear_cases(mtq) -> dict[str, dict]:
    """The linear cases: name -> Model Optimizer config dict (deep copies of presets or hand-written)."""
    w_int8 = {"num_bits": 8, "axis": None}
    return {
        "int8_default": copy.deepcopy(mtq.INT8_DEFAULT_CFG),  # weights per channel (axis 0), inputs per tensor
        "int8_per_tensor": {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                                          {"quantizer_name": "*weight_quantizer", "cfg": w_int8},
                                          {"quantizer_name": "*input_quantizer", "cfg": w_int8}],
                            "algorithm": "max"},
        "int8_narrow": {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                                      {"quantizer_name": "*weight_quantizer", "cfg": {**w_int8, "narrow_range": True}},
                                      {"quantizer_name": "*input_quantizer", "cfg": {**w_int8, "narrow_range": True}}],
                        "algorithm": "max"},
        "int4_per_tensor": {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                                          {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 4, "axis": None}},
                                          {"quantizer_name": "*input_quantizer", "cfg": {"num_bits": 4, "axis": None}}],
                            "algorithm": "max"},
        "int4_blockwise": copy.deepcopy(mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG),  # static blocks of 128, fc3 padded
        # The legacy flat dict form with a "default" catch-all and an algorithm dict.
        "int8_legacy_dict": {"quant_cfg": {"*weight_quantizer": {"num_bits": 8, "axis": 0},
                                           "*input_quantizer": {"num_bits": 8, "axis": None},
                                           "*output_quantizer": {"enable": False},
                                           "*fc3*": {"enable": False}},
                             "algorithm": {"method": "max", "distributed_sync": True}},
        "fp8_default": copy.deepcopy(mtq.FP8_DEFAULT_CFG),
        "fp8_per_channel_per_token": copy.deepcopy(mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG),
        # parent_class as written upstream, on an nn.Linear subclass would match too.
        "fp8_parent_class": {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                                           {"quantizer_name": "*weight_quantizer", "parent_class": "nn.Linear",
                                            "cfg": {"num_bits": (4, 3), "axis": None}},
                                           {"quantizer_name": "*input_quantizer", "parent_class": "nn.Linear",
                                            "cfg": {"num_bits": (4, 3), "axis": None}},
                                           {"quantizer_name": "fc2.*", "enable": False}],
                             "algorithm": "max"},
    }


BF16_CASES = ("fp8_default", "int8_default")
MTO_SAVE_CASES = ("int8_default", "int4_blockwise", "fp8_default")  # the file mto.save writes, for restore tests


def make_linear(out: Path) -> None:
    """Runs every linear case through Model Optimizer and writes ``linear_cases.pt.xz`` and ``presets.pt`` to
    ``out``."""
    warnings.filterwarnings("ignore")
    import modelopt.torch.opt as mto
    import modelopt.torch.quantization as mtq

    base = linear_model()
    calib, test = linear_inputs()
    cases = {}
    for name, config in linear_cases(mtq).items():
        for dtype in (torch.float32, torch.bfloat16) if name in BF16_CASES else (torch.float32,):
            model = copy.deepcopy(base).to(dtype)
            x_cal, x_test = calib.to(dtype), test.to(dtype)
            mtq.quantize(model, copy.deepcopy(config), lambda m, x=x_cal: m(x))
            with torch.no_grad():
                y = model(x_test)
                # Outputs of enabled quantizers only (a disabled one returns its input).
                iq = model.fc1.input_quantizer
                in_q = iq(x_test).clone() if iq.is_enabled else None
                w_q = {n: getattr(model, n).weight_quantizer(getattr(model, n).weight).clone()
                       for n in ("fc1", "fc2", "fc3") if getattr(model, n).weight_quantizer.is_enabled}
            key = name if dtype == torch.float32 else f"{name}_bf16"
            cases[key] = {
                "config": config, "dtype": str(dtype).removeprefix("torch."),
                "amax": {k: v.clone() for k, v in model.state_dict().items() if k.endswith("_amax")},
                "fc1_input_q": pack(in_q), "weight_q": {n: pack(w) for n, w in w_q.items()}, "output": y.clone(),
                "quantizer_state": {n: m.get_modelopt_state() for n, m in model.named_modules()
                                    if type(m).__name__.endswith("Quantizer")},
            }
            if key in MTO_SAVE_CASES:
                buf = io.BytesIO()
                mto.save(model, buf)
                cases[key]["mto_save"] = buf.getvalue()
            print(f"linear case {key}: amax keys {sorted(cases[key]['amax'])[:3]}...")
    payload = {"model_state": base.state_dict(), "calib": calib, "test": test, "cases": cases,
               "modelopt_version": __import__("modelopt").__version__, "torch_version": str(torch.__version__)}
    raw = io.BytesIO()
    torch.save(payload, raw)
    (out / "linear_cases.pt.xz").write_bytes(lzma.compress(raw.getvalue(), preset=9 | lzma.PRESET_EXTREME))
    presets = {n: copy.deepcopy(getattr(mtq, n)) for n in ("FP8_DEFAULT_CFG", "NVFP4_DEFAULT_CFG", "INT8_DEFAULT_CFG",
                                                           "INT4_BLOCKWISE_WEIGHT_ONLY_CFG", "INT8_WEIGHT_ONLY_CFG",
                                                           "FP8_PER_CHANNEL_PER_TOKEN_CFG", "NVFP4_EXPERTS_ONLY_CFG",
                                                           "W4A16_NVFP4_CFG", "INT4_AWQ_CFG", "W4A8_AWQ_BETA_CFG")}
    torch.save(presets, out / "presets.pt")


def mx_input() -> torch.Tensor:
    """The tensor the MX exporters quantize: 64 rows of 256, row magnitudes from 1e-20 to 1e20."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 256, generator=g) * torch.logspace(-20, 20, 64).unsqueeze(-1)


def make_mx(out: Path) -> None:
    """Writes ``mx.pt.xz``: Model Optimizer's MX presets, quantizer states, and its CPU MX exporters' output."""
    warnings.filterwarnings("ignore")
    import modelopt.torch.quantization as mtq
    from modelopt.torch.quantization.nn import TensorQuantizer
    from modelopt.torch.quantization.qtensor.mxfp4_tensor import MXFP4QTensor
    from modelopt.torch.quantization.qtensor.mxfp8_tensor import MXFP8QTensor

    presets = {n: copy.deepcopy(getattr(mtq, n)) for n in ("MXFP4_DEFAULT_CFG", "MXFP8_DEFAULT_CFG")}
    states = {}
    for name, preset in presets.items():
        cfg = next(e["cfg"] for e in preset["quant_cfg"] if e["quantizer_name"] == "*weight_quantizer")
        states[name] = TensorQuantizer(mtq.config.QuantizerAttributeConfig(**cfg)).get_modelopt_state()
    x = mx_input()
    packed4, scale4 = MXFP4QTensor.quantize(x, 32)
    q8, scale8 = MXFP8QTensor.quantize(x)
    exporters = {  # of mx_input(), which the tests make again (the same bits from the same seed)
        "mxfp4": {"e8m0": scale4.clone(), "values": packed4.dequantize(torch.float32, scale=scale4,
                                                                       block_sizes={-1: 32}).reshape(x.shape)},
        "mxfp8": {"e8m0": scale8.clone(), "values": q8.dequantize(torch.float32, scale=scale8).reshape(x.shape)},
    }
    raw = io.BytesIO()
    torch.save({"presets": presets, "quantizer_state": states, "exporters": exporters,
                "modelopt_version": __import__("modelopt").__version__}, raw)
    (out / "mx.pt.xz").write_bytes(lzma.compress(raw.getvalue(), preset=9 | lzma.PRESET_EXTREME))


# ---------------------------------------------------------------------------------------------------------------
# Megatron MoE GPT, dist checkpoint

MEGATRON = {"num_layers": 2, "hidden": 16, "ffn_hidden": 32, "num_experts": 4, "vocab_size": 64, "seq_len": 16,
            "seed": 4321}
_LOCAL = re.compile(r"\.local_experts\.(\d+)\.")


def _megatron_rank(rank: int, world: int, ckpt_dir: str) -> dict:
    warnings.filterwarnings("ignore")
    import megatron_harness.models as mm

    mm.init_model_parallel(tp=1, ep=world, seed=MEGATRON["seed"])
    model = mm.build_moe_gpt(**{k: v for k, v in MEGATRON.items() if k != "seed"}, seed=MEGATRON["seed"])
    # Model Optimizer after megatron.core (its Megatron plugin registers on import).
    import modelopt.torch.quantization as mtq
    from megatron.core import dist_checkpointing, parallel_state
    from modelopt.torch.opt.plugins.mcore_dist_checkpointing import save_sharded_modelopt_state

    vocab, seq = MEGATRON["vocab_size"], MEGATRON["seq_len"]
    batches = mm.text_batches(batch_size=2, seq_len=seq, num_batches=3, vocab_size=vocab)
    evaluation = mm.text_batches(batch_size=2, seq_len=seq, num_batches=1, vocab_size=vocab, offset=100)[0]

    def forward_loop(m):
        for b in batches:
            mm.lm_loss(m, b)

    model.eval()
    mtq.quantize(model, copy.deepcopy(mtq.FP8_DEFAULT_CFG), forward_loop)
    with torch.no_grad():
        logits = mm.gather_logits(model, evaluation)
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    save_sharded_modelopt_state([model], ckpt_dir)
    n_local = MEGATRON["num_experts"] // world
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    amax = {}
    for name, t in model.state_dict().items():
        if name.endswith("_amax"):
            amax[_LOCAL.sub(lambda m: f".local_experts.{ep_rank * n_local + int(m.group(1))}.", name)] = t.clone()
    return {"amax": amax, "logits": logits.clone() if rank == 0 else None}


def make_megatron(out: Path) -> None:
    """Writes Model Optimizer's FP8 Megatron MoE checkpoint (TP1 EP2, two ranks) and its amaxes and logits to
    ``out``."""
    from modelopt_moe.launch import spawn

    name = "megatron_moe_fp8_tp1ep2"
    ckpt = out / name
    if ckpt.exists():
        shutil.rmtree(ckpt)
    # A relative path: torch's checkpoint metadata records the directory it was written to.
    results = spawn(_megatron_rank, 2, args=(os.path.relpath(ckpt),), timeout=600)
    amax = {}
    for r in results:
        for k, v in r["amax"].items():
            if k in amax and not torch.equal(amax[k], v):
                raise RuntimeError(f"{k}: ranks disagree on a replicated amax")
            amax[k] = v
    torch.save({"amax": amax, "logits": results[0]["logits"], "model": MEGATRON, "config": "FP8_DEFAULT_CFG",
                "layout": {"tp": 1, "ep": 2}}, out / f"{name}.amax.pt")
    print(f"{name}: {len(amax)} amaxes, files {sorted(p.name for p in ckpt.rglob('*'))}")


def main() -> None:
    """Makes the fixtures of ``--part`` in ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--part", choices=("all", "linear", "megatron", "mx"), default="all")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part in ("all", "linear"):
        make_linear(args.out)
    if args.part in ("all", "megatron"):
        make_megatron(args.out)
    if args.part in ("all", "mx"):
        make_mx(args.out)


if __name__ == "__main__":
    main()
