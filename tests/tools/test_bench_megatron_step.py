"""tools/bench_megatron_step.py runs a whole Megatron training step of every variant and mode and reports each one.

A tiny smoke configuration on CPU (its own process: world size 1, gloo, the project's CPU shims and grouped experts
in Megatron's local spec instead of Transformer Engine). Not a timing test: only the table's structure is checked.
"""

import argparse
import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from limits import seconds  # noqa: E402

pytestmark = pytest.mark.slow  # runs the tool: processes and training

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--layers", "1", "--hidden", "64", "--experts", "4", "--moe-ffn-hidden", "32", "--topk", "2", "--heads", "4",
        "--kv-heads", "2", "--seq", "32", "--vocab", "256", "--dispatcher", "allgather", "--micro-batches", "2",
        "--rounds", "2", "--steps", "1", "--warmup", "0", "--calib-batches", "1"]
OURS = ("bf16", "fp8", "nvfp4", "nvfp4_4over6", "fp8-te_fp8")
MODES = {"re-quantize": 1, "reuse": 2}


def _positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_tiny_cpu_run_reports_every_variant_and_mode(tmp_path):
    out = tmp_path / "rows.json"
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_megatron_step.py"), *TINY, "--json", str(out)],
                         capture_output=True, text=True, timeout=seconds(600))
    assert res.returncode == 0, res.stderr[-3000:]
    for variant in OURS:
        for mode, micro_batches in MODES.items():
            assert re.search(rf"^{variant}\s+{mode} \({micro_batches} mb\)\s+\d", res.stdout, re.M), res.stdout
    if importlib.util.find_spec("modelopt") is None:
        assert "skipped modelopt-fp8, " not in res.stdout  # one line per variant, each with its reason
        assert re.search(r"^skipped modelopt-fp8: modelopt does not import", res.stdout, re.M), res.stdout
        assert re.search(r"^skipped modelopt-nvfp4: ", res.stdout, re.M), res.stdout

    rows = {(r["variant"], r["mode"]): r for r in json.loads(out.read_text())}
    assert {key for key in rows if key[0] in OURS} == {(v, m) for v in OURS for m in MODES}
    for (variant, mode), row in rows.items():
        assert row["micro_batches"] == MODES[mode]
        for key in ("ms", "ms_per_micro_batch", "x_bf16", "x_bf16_min", "x_bf16_max"):
            assert _positive(row[key]), (variant, mode, key, row[key])
        assert row["x_bf16_min"] <= row["x_bf16"] <= row["x_bf16_max"]
        assert row["ms_per_micro_batch"] == pytest.approx(row["ms"] / MODES[mode])
        assert row["peak_mib"] is None  # CUDA memory statistics only
    assert rows["bf16", "reuse"]["x_bf16"] == 1.0


# What each family's tiny model must show in its pieces line (the shipped configs/<family>_tiny.json, local spec).
FAMILY_PIECES = {
    "deepseek_v3": ("attention MLASelfAttention", "core attention LatentDotProductAttention", "experts SequentialMLP",
                    "MLA q/kv LoRA ranks (48, 32)", "dense MLP layers [0]", "shared experts [1, 2]",
                    "router sigmoid top-4", "router groups (4, 2)", "expert bias [1, 2]"),
    "gpt_oss": ("attention SelfAttention", "core attention DotProductAttention", "experts SequentialMLP",
                "sinks [0, 1, 2]", "windows [(3, 0), None, (3, 0)]", "biases ['qkv', 'proj', 'router', 'experts']",
                "activation quick_gelu GLU +1 clamped at 7", "rope YarnRotaryEmbedding"),
}


@pytest.mark.parametrize("model", sorted(FAMILY_PIECES))
def test_family_model_tiny_cpu_run_builds_the_family_and_reports_its_pieces(model, tmp_path):
    """``--model deepseek_v3|gpt_oss --tiny``: the family's shipped tiny config built by ``build_megatron_model``
    (local spec on CPU), its pieces printed, and a bf16 and an FP8 variant trained and timed in both modes (gpt-oss's
    expert biases at tensor- and expert-parallel size 1 included)."""
    out = tmp_path / "rows.json"
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_megatron_step.py"), "--model", model, "--tiny",
                          "--variants", "bf16", "fp8", "--micro-batches", "2", "--rounds", "1", "--steps", "1",
                          "--warmup", "0", "--calib-batches", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=seconds(600))
    assert res.returncode == 0, res.stderr[-3000:]
    line = re.search(rf"^{model} model pieces: (.*)$", res.stdout, re.M)
    assert line, res.stdout
    for piece in FAMILY_PIECES[model]:
        assert piece in line.group(1), (piece, line.group(1))
    spec = f"({model}-shaped, build_megatron_model(spec='local') from its Hugging Face config): 3 layers ("
    assert spec in res.stdout
    assert "seq 32, micro-batch 1, vocab 256, allgather dispatcher" in res.stdout
    rows = {(r["variant"], r["mode"]): r for r in json.loads(out.read_text())}
    assert set(rows) == {(v, m) for v in ("bf16", "fp8") for m in MODES}
    assert all(_positive(r["ms"]) for r in rows.values())
    built = {v: int(n) for v, n in re.findall(r"^built (\w+): (\d+) weight quantizers enabled", res.stdout, re.M)}
    assert built["bf16"] == 0, built
    assert built["fp8"] > 0, built


def test_a_family_model_without_a_piece_of_its_config_stops_the_run():
    """The pieces are read from the built model's modules and compared with what the config asks for: a model that
    lacks one (here: built from a DeepSeek-V3 config with shared experts, checked against the same config without them)
    is refused naming the piece, so a plainer model cannot be timed in its place."""
    script = f"""
import copy, sys
sys.path.insert(0, {str(ROOT / "tools")!r})
import bench_megatron_step as tool
args = tool.parse_args(["--model", "deepseek_v3", "--tiny"])
tool.init_distributed(args.seed)
model = tool.build_family_gpt(args, args.seed)
print("OK", tool.check_pieces(model, args))
args.hf = {{**copy.deepcopy(args.hf), "n_shared_experts": 0, "first_k_dense_replace": 2}}
try:
    tool.check_pieces(model, args)
except RuntimeError as e:
    print("REFUSED", e)
"""
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=seconds(300))
    assert res.returncode == 0, res.stderr[-3000:]
    assert re.search(r"^OK attention MLASelfAttention, ", res.stdout, re.M), res.stdout
    refused = re.search(r"^REFUSED (.*)$", res.stdout, re.M)
    assert refused, res.stdout
    assert refused.group(1) == (
        "--model deepseek_v3: the built model lacks pieces of its config: dense MLP layers: expected [0, 1], "
        "built [0]; shared experts: expected [], built [1, 2]; expert bias: expected [2], built [1, 2]")


def _load_tool():
    spec = importlib.util.spec_from_file_location("bench_megatron_step", ROOT / "tools" / "bench_megatron_step.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_residency_parks_only_what_does_not_fit_and_reversed_rounds_reuse_the_residents():
    """Three variants, room for two: building the third parks the first; after that each round moves one variant
    (the reversed order lets the two still resident go first). Moves are recorded instead of done (no GPU here)."""
    tool = _load_tool()
    moves = []

    class Recorded(tool.Residency):
        def _park(self, variant):
            moves.append(("park", variant.name))

        def _unpark(self, variant):
            moves.append(("unpark", variant.name))

    residency = Recorded(limit=2)
    variants = []
    for name in ("a", "b", "c"):
        residency.make_room()
        variants.append(tool.Variant(name, trainer=None, weight_quantizers=0))
        residency.resident.append(variants[-1])
    assert moves == [("park", "a")]
    times = tool.time_rounds(variants, _NoSteps(), argparse.Namespace(rounds=3, warmup=1, steps=1), residency)
    assert moves[1:] == [("park", "c"), ("unpark", "a"), ("park", "a"), ("unpark", "c"), ("park", "c"),
                         ("unpark", "a")]
    assert {key: len(ms) for key, ms in times.items()} == {(n, m): 3 for n in "abc" for m in MODES}


class _NoSteps:
    """Stands in for the tool's ``Steps``: every mode's step does nothing."""

    modes = MODES

    def __call__(self, variant, mode):
        return lambda: None
