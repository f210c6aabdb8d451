"""Formats are objects: behaviour that depends on the number format is read from the format's attributes, and only a
format's own home module (where its object is built) spells its name to choose behaviour.

Read from the sources (every module of ``modelopt_moe`` and ``modelopt_moe.plugins``): outside a format's home no
comparison, dict key, subscript or call argument is one of its names or aliases (``"nvfp4"``, ``"e2m1"``, ``"e4m3"``,
``"fp8"``, ``"int4"``, ...). Docstrings, messages and defaults may still name formats.
"""

import ast
import sys
from pathlib import Path

import pytest

from modelopt_moe.numerics import FORMATS, Format, KernelSpec, ScaleLayout
from modelopt_moe.numerics.format import ExportCodec

REPO = Path(__file__).resolve().parents[3]
SOURCES = [REPO / "modelopt_moe", REPO / "plugins"]


def _home(fmt: Format) -> Path:
    return Path(sys.modules[type(fmt).__module__].__file__).resolve()


def _names() -> dict[str, Path]:
    """Every name and alias of a registered format -> the home module of that format."""
    return {name: _home(f) for f in FORMATS.values() for name in {f.name, *f.aliases}}


def _constants(node: ast.AST) -> list[str]:
    """String constants at ``node`` or directly inside a tuple, list or set there."""
    items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return [n.value for n in items if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _name_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, string) of every string a comparison, dict key, subscript or call argument uses."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.Dict):
            operands = [k for k in node.keys if k is not None]
        elif isinstance(node, ast.Subscript):
            operands = [node.slice]
        elif isinstance(node, ast.Call):
            operands = [*node.args, *(k.value for k in node.keywords)]
        else:
            continue
        found += [(node.lineno, s) for operand in operands for s in _constants(operand)]
    return found


def test_no_module_outside_a_formats_home_chooses_behaviour_by_its_name():
    names = _names()
    offenders = []
    for root in SOURCES:
        for path in sorted(root.rglob("*.py")):
            for line, s in _name_uses(ast.parse(path.read_text(), str(path))):
                if s in names and names[s] != path.resolve():
                    offenders.append(f"{path.relative_to(REPO)}:{line}: {s!r}")
    assert not offenders, "format names compared outside their formats' homes:\n" + "\n".join(offenders)


def test_the_name_check_sees_a_comparison_a_table_and_a_lookup():
    uses = _name_uses(ast.parse('x = fmt == "nvfp4" or fmt in ("e4m3", "e5m2")\nt = {"int4": 1}\nFORMATS["int8"]'))
    assert sorted(s for _, s in uses) == ["e4m3", "e5m2", "int4", "int8", "nvfp4"]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_format_is_one_object_that_answers_for_itself(name):
    f = FORMATS[name]
    assert isinstance(f, Format)
    assert f.name == name
    assert isinstance(f.kernel, KernelSpec)
    assert f.scale_layouts
    assert all(isinstance(layout, ScaleLayout) for layout in f.scale_layouts)
    assert f.export is None or isinstance(f.export, ExportCodec)
    assert (f.block is not None) == (f.block_length is not None)


def test_only_formats_whose_scales_all_come_from_the_data_need_no_amax():
    # The one place of the rule: a format with blocks of the data's own amax (int and FP8 blocks) needs no amax with
    # a block, nor does an MX format ever (E8M0 block scales, selected by their scale_bits); everything else does.
    mx = {n for n, f in FORMATS.items() if f.scale_bits is not None}
    assert mx == {"mxfp4", "mxfp8"}
    assert {n for n, f in FORMATS.items() if not f.needs_amax(128)} == {
        n for n, f in FORMATS.items() if ScaleLayout.BLOCKS_1D in f.scale_layouts}
    assert {n for n, f in FORMATS.items() if f.integer} < {n for n, f in FORMATS.items() if not f.needs_amax(128)}
    assert {n for n, f in FORMATS.items() if not f.needs_amax(None)} == mx


def test_two_dimensional_blocks_have_a_layout():
    assert ScaleLayout.BLOCKS_2D.value == "2-D blocks"
