r"""Make the Model Optimizer 0.47 FP8 block-wise fixture (run once; the output is committed).

The file is ``tests/fixtures/modelopt_0_47/fp8_block_cases.pt.xz``. The same environment as
``tools/make_modelopt_fixtures.py``; then::

    .venv-modelopt/bin/python tools/make_modelopt_fp8_block_fixtures.py [--out DIR]

One ``nn.Linear(200, 160)`` (both dims not multiples of 128, so the 2-D blocks of its weight are partial at both
ends), quantized by ``mtq.quantize`` with ``FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG`` and with the same weights plus the
per-token input groups ``{"num_bits": (4, 3), "type": "dynamic", "block_sizes": {-1: 128}}``, in fp32 and bf16 (its
FP8 block path runs on CPU: ``fp8_eager``). Per case: the config, the calibrated amaxes, the weight quantizer's
output, the input quantizer's output on 9 x 200 test activations, and whether Model Optimizer quantizes 5 tokens
after calibrating on 9 (it fixes the block view's shape at its first call).
"""

from __future__ import annotations

import argparse
import copy
import io
import lzma
import warnings
from pathlib import Path

import torch
from torch import nn

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "modelopt_0_47"
INPUT_GROUPS = {"num_bits": (4, 3), "type": "dynamic", "block_sizes": {-1: 128}}


def _cases(mtq) -> dict:
    weight_only = copy.deepcopy(mtq.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG)
    w8a8 = copy.deepcopy(mtq.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG)
    w8a8["quant_cfg"].append({"quantizer_name": "*input_quantizer", "cfg": INPUT_GROUPS})
    return {"fp8_2d_weight_only": weight_only, "fp8_2d_w8a8": w8a8}


def main() -> None:
    """Quantizes the cases with Model Optimizer and writes the fixture."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    import modelopt
    import modelopt.torch.quantization as mtq

    torch.manual_seed(0)
    base = nn.Linear(200, 160)
    with torch.no_grad():  # a spread of magnitudes per block, so that block scales differ
        base.weight.mul_(torch.logspace(-2, 1, 160).unsqueeze(1))
    calib = torch.randn(9, 200) * torch.logspace(-1, 1, 200)
    test = torch.randn(9, 200) * torch.logspace(-1, 1, 200) * 1.5
    cases = {}
    for name, config in _cases(mtq).items():
        for dtype in (torch.float32, torch.bfloat16):
            model = copy.deepcopy(base).to(dtype)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mtq.quantize(model, copy.deepcopy(config), lambda m, d=dtype: m(calib.to(d)))
            with torch.no_grad():
                weight_q = model.weight_quantizer(model.weight)
                input_q = model.input_quantizer(test.to(dtype)) if model.input_quantizer.is_enabled else None
                try:
                    model(test[:5].to(dtype))
                    fewer_tokens = "ok"
                except Exception as e:  # noqa: BLE001 - recorded, the test states it
                    fewer_tokens = f"{type(e).__name__}: {e}"
            amax = {k: v.clone() for k, v in model.state_dict().items() if k.endswith("_amax")}
            cases[f"{name}_{str(dtype).removeprefix('torch.')}"] = {
                "config": config, "dtype": str(dtype).removeprefix("torch."), "amax": amax, "weight_q": weight_q,
                "input_q": input_q, "fewer_tokens": fewer_tokens}
    buf = io.BytesIO()
    torch.save({"modelopt_version": modelopt.__version__, "weight": base.weight.detach(), "bias": base.bias.detach(),
                "calib": calib, "test": test, "cases": cases}, buf)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fp8_block_cases.pt.xz").write_bytes(lzma.compress(buf.getvalue()))


if __name__ == "__main__":
    main()
