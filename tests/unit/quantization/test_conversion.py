"""Registration: one explicit call (made by ``mtq.quantize`` and every restore) registers the framework-free wrappers
and the imported frameworks' plugins alike; registry lookups change nothing; a user's own registration wins over the
framework-free defaults. Each case runs in a fresh interpreter (registrations are per process)."""

import subprocess
import sys


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_lookups_register_nothing_and_quantize_registers_what_it_uses():
    out = _run("import torch\n"
               "import modelopt_moe.quantization as mtq\n"
               "before = torch.nn.Linear in mtq.QuantModuleRegistry\n"
               "model = mtq.quantize(torch.nn.Sequential(torch.nn.Linear(4, 4)), mtq.FP8_DEFAULT_CFG,\n"
               "                     lambda m: m(torch.randn(2, 4)))\n"
               "print(before, torch.nn.Linear in mtq.QuantModuleRegistry, type(model[0]).__name__)")
    assert out == "False True QuantLinear"


def test_a_users_registration_wins_over_the_framework_free_default():
    out = _run("import torch\n"
               "import modelopt_moe.quantization as mtq\n"
               "from modelopt_moe.quantization.nn import QuantLinearMixin\n"
               "class Mine(QuantLinearMixin):\n"
               "    pass\n"
               "mtq.QuantModuleRegistry.register(torch.nn.Linear, Mine)\n"
               "model = mtq.quantize(torch.nn.Sequential(torch.nn.Linear(4, 4)), mtq.FP8_DEFAULT_CFG,\n"
               "                     lambda m: m(torch.randn(2, 4)))\n"
               "print(isinstance(model[0], Mine))")
    assert out == "True"
