"""Export adapters come from plugins through the core's one registration call (modelopt_moe/export/registry.py).

``modelopt_moe.export`` imports no framework; ``register_framework_plugins(require="megatron")`` imports and
registers the Megatron plugin (and its export adapter) in a program that never imported megatron.core.
"""

import subprocess
import sys

import pytest
from torch import nn

from modelopt_moe.export import ExportError, export_hf, import_hf
from modelopt_moe.export.registry import register_export_adapter
from modelopt_moe.quantization.conversion import register_framework_plugins


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow  # a fresh interpreter (or spawned ranks)
def test_the_export_core_imports_no_framework():
    out = _run("import sys, modelopt_moe.export\n"
               "print(sorted({m.split('.')[0] if not m.startswith('modelopt_moe.plugins') else m for m in sys.modules"
               " if m.startswith(('megatron', 'transformer_engine', 'transformers', 'safetensors',"
               " 'modelopt_moe.plugins'))}))")
    assert out.strip() == "[]"


@pytest.mark.slow  # a fresh interpreter (or spawned ranks)
def test_require_registers_the_megatron_plugin_before_megatron_is_imported():
    out = _run("import sys\n"
               "from modelopt_moe.quantization.conversion import register_framework_plugins\n"
               "from modelopt_moe.export.registry import registered_adapters\n"
               "assert 'megatron.core' not in sys.modules and register_framework_plugins() == []\n"
               "print(register_framework_plugins(require='megatron'), 'megatron.core' in sys.modules, "
               "registered_adapters())")
    assert out.strip() == "['megatron'] True ['megatron']"


def test_unknown_plugin_and_unowned_model():
    with pytest.raises(ValueError, match=r"unknown plugin\(s\) \['tensorflow'\]"):
        register_framework_plugins(require="tensorflow")
    with pytest.raises(ExportError, match="no export adapter for a Linear"):
        export_hf(nn.Linear(4, 4), "/nonexistent/out")
    with pytest.raises(ExportError, match="no export adapter for a Linear"):
        import_hf(nn.Linear(4, 4), "/nonexistent/in")
    with pytest.raises(TypeError, match="is not an ExportAdapter"):
        register_export_adapter(object())


def test_export_hf_of_an_empty_list_of_chunks_is_refused(tmp_path):
    with pytest.raises(ExportError, match="empty list of model chunks"):
        export_hf([], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_import_hf_of_an_empty_list_of_chunks_or_of_chunks_no_adapter_owns_is_refused(tmp_path):
    with pytest.raises(ExportError, match=r"import_hf: an empty list of model chunks"):
        import_hf([], tmp_path)
    with pytest.raises(ExportError, match="no export adapter for a Linear"):
        import_hf([nn.Linear(4, 4), nn.Linear(4, 4)], tmp_path)
