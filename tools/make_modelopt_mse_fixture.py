r"""Make ``tests/fixtures/modelopt_0_47/mse_cases.pt``: the weight amaxes NVIDIA Model Optimizer 0.47's MSE search
(``algorithm: {"method": "mse", ...}``) chooses on CPU (run once; the output is committed).

In the environment of ``tools/make_modelopt_fixtures.py`` (Model Optimizer 0.47 installed beside this package)::

    .venv-modelopt/bin/python tools/make_modelopt_mse_fixture.py [--out FILE]

The model: ``nn.Sequential`` of ``nn.Linear(64, 48)``, ReLU, ``nn.Linear(48, 16)`` (seed 0), fp32; the
calibration data ``randn(32, 64)`` (seed 1). Per case: the config as given to ``mtq.quantize`` and every
``*weight_quantizer._amax`` / ``*input_quantizer._amax`` Model Optimizer calibrated. fp32 only: in bf16 Model
Optimizer keeps amaxes in the model's dtype, so its candidates and its choice are rounded to bf16
(docs/calibration.md).
"""

from __future__ import annotations

import argparse
import copy
import warnings
from pathlib import Path

import torch
from torch import nn

CASES = {
    "fp8_per_tensor": ({"num_bits": (4, 3), "axis": None}, {}),
    "fp8_per_channel": ({"num_bits": (4, 3), "axis": 0}, {}),
    "int8_per_channel": ({"num_bits": 8, "axis": 0}, {}),
    "int8_per_tensor_coarse_grid": ({"num_bits": 8, "axis": None},
                                    {"step_size": 0.25, "start_multiplier": 0.5, "stop_multiplier": 2.0}),
    "int4_static_blocks": ({"num_bits": 4, "block_sizes": {-1: 16}}, {}),
}


def model_and_data():
    """The fixture's model and calibration data."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 16))
    data = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    return model, data


def config(weight_cfg: dict, grid: dict) -> dict:
    """A case's config: weights as ``weight_cfg``, FP8 per-tensor inputs, the MSE search on ``grid``."""
    return {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                          {"quantizer_name": "*weight_quantizer", "cfg": weight_cfg},
                          {"quantizer_name": "*input_quantizer", "cfg": {"num_bits": (4, 3), "axis": None}}],
            "algorithm": {"method": "mse", **grid}}


def main() -> None:
    """Quantizes the model with every case and saves what Model Optimizer chose."""
    import modelopt
    import modelopt.torch.quantization as mtq

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tests/fixtures/modelopt_0_47/mse_cases.pt")
    args = parser.parse_args()
    base, data = model_and_data()
    cases = {}
    for name, (weight_cfg, grid) in CASES.items():
        model = copy.deepcopy(base)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mtq.quantize(model, copy.deepcopy(config(weight_cfg, grid)), lambda m: m(data))
        amaxes = {k: v.clone() for k, v in model.state_dict().items() if k.endswith("_amax")}
        cases[name] = {"config": config(weight_cfg, grid), "amax": amaxes}
    torch.save({"modelopt_version": modelopt.__version__, "model_state": base.state_dict(), "calib": data,
                "cases": cases}, Path(args.out))


if __name__ == "__main__":
    main()
