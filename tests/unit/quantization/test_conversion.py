"""Registration: one explicit call (made by ``mtq.quantize``, every restore and every registry lookup) registers the
framework-free wrappers and the imported frameworks' plugins alike, so ``ColumnParallelLinear in
mtq.QuantModuleRegistry`` holds as in Model Optimizer, whichever was imported first; importing ``mtq`` imports no
framework; a user's own registration wins over the framework-free defaults. Each case runs in a fresh interpreter
(registrations are per process)."""

import subprocess
import sys


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_lookups_see_the_framework_free_wrappers_before_any_quantize():
    out = _run("import torch\n"
               "import modelopt_moe.quantization as mtq\n"
               "before = torch.nn.Linear in mtq.QuantModuleRegistry\n"
               "model = mtq.quantize(torch.nn.Sequential(torch.nn.Linear(4, 4)), mtq.FP8_DEFAULT_CFG,\n"
               "                     lambda m: m(torch.randn(2, 4)))\n"
               "print(before, torch.nn.Linear in mtq.QuantModuleRegistry, type(model[0]).__name__)")
    assert out == "True True QuantLinear"


MEGATRON_LINEARS = ("from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear\n"
                    "from megatron.core.transformer.moe.experts import SequentialMLP\n"
                    "megatron = (ColumnParallelLinear, RowParallelLinear, SequentialMLP)\n")
LOOKUPS = ("print([c in mtq.QuantModuleRegistry for c in megatron],\n"
           "      mtq.QuantModuleRegistry.get(ColumnParallelLinear).__name__,\n"
           "      ColumnParallelLinear in list(mtq.QuantModuleRegistry))\n")


def test_megatron_linears_are_in_the_registry_when_megatron_is_imported_first():
    out = _run("import warnings\nwarnings.simplefilter('ignore')\n" + MEGATRON_LINEARS
               + "import modelopt_moe.quantization as mtq\n" + LOOKUPS)
    assert out == "[True, True, True] QuantColumnParallelLinear True"


def test_importing_mtq_imports_no_megatron_and_megatron_imported_later_is_in_the_registry():
    out = _run("import sys, warnings\nwarnings.simplefilter('ignore')\n"
               "import torch\n"
               "import modelopt_moe.quantization as mtq\n"
               "assert torch.nn.Linear in mtq.QuantModuleRegistry\n"
               "print(sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'transformer_engine')))\n"
               + MEGATRON_LINEARS + LOOKUPS)
    assert out == "[]\n[True, True, True] QuantColumnParallelLinear True"


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
