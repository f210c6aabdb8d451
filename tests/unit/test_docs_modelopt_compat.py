"""docs/modelopt_compat.md: its runnable snippet runs as written, and every anchor the errors point to exists."""

import re
from pathlib import Path

import modelopt_moe.quantization.modelopt_compat as compat

DOC = Path(__file__).resolve().parents[2] / compat.COMPAT_DOC


def _python_blocks(text: str) -> list[str]:
    return [m.group(1) for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M)]


def test_the_coming_from_model_optimizer_snippet_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = [b for b in _python_blocks(DOC.read_text()) if "load_modelopt_checkpoint" not in b]
    assert blocks
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), {"__name__": "__doc_snippet__"})


def test_error_messages_point_to_sections_that_exist():
    text = DOC.read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}
    sources = "\n".join(p.read_text() for p in (DOC.parents[1] / "modelopt_moe").rglob("*.py"))
    used = set(re.findall(r"modelopt_compat\.md#([a-z0-9-]+)", sources)) | set(re.findall(r"COMPAT_DOC\}#([a-z0-9-]+)",
                                                                                           sources))
    used |= set(re.findall(r'section: str = "([a-z0-9-]+)"', sources))
    assert used, used - anchors
    assert used <= anchors, used - anchors
