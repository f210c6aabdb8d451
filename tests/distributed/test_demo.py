"""``modelopt-moe demo``: argument checks before any process starts, and a shortened end-to-end run (with no layout
flag on this GPU-less machine: 4 gloo ranks at TP=2 x EP=2, the shipped Qwen3-MoE-shaped config, NVFP4 experts)
whose output, report, plots and numbers are checked, the held-out top-1 agreement and greedy generation among
them."""

import json
import math
import os
import re
import subprocess
import sys

import pytest
from limits import seconds  # noqa: E402

from modelopt_moe.plugins.cli import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cpu", "--tp", "3"], "--tp 3 must divide the world size 4"),
        (["--cpu", "--ep", "3"], "--ep 3 must divide the world size 4"),
        (["--cpu", "--tp", "2", "--seq-len", "33"], "--seq-len 33 must be a multiple of --tp 2"),
        (["--cpu", "--world-size", "16", "--ep", "16"], "--ep 16 must divide the model's 8 experts"),
        (["--steps", "-1"], "--steps must be >= 0"),
    ],
)
def test_demo_rejects_inconsistent_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["demo", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_fails_fast_on_a_bad_config_or_a_foreign_out_dir(tmp_path, capsys):
    bad = tmp_path / "typo.yaml"
    bad.write_text("algorithmm: max\n")
    assert main(["demo", "--config", str(bad), "--out", str(tmp_path / "r")]) == 2
    assert "typo.yaml" in capsys.readouterr().err
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    assert main(["demo", "--out", str(foreign)]) == 2
    assert "holds other files than a demo report" in capsys.readouterr().err
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_shortened_demo_runs_every_stage_and_writes_a_sane_report(tmp_path, capfd):
    out = tmp_path / "report"
    rc = main(["demo", "--out", str(out), "--train-steps", "40", "--steps", "8", "--seq-len", "32",
               "--timeout", "840"])
    captured = capfd.readouterr()
    printed, err = captured.out, captured.err
    assert rc == 0, printed + err[-3000:]
    # the first line says the layout chosen for this machine, and why
    assert printed.startswith("modelopt-moe demo: 4 CPU processes (gloo), TP=2 x EP=2 (no GPU visible"), printed
    for i in range(1, 7):  # every stage says what it proved, once (rank 0 only)
        assert printed.count(f"[{i}/6] ") == 1, printed
    # a log, not a terminal: progress as plain lines; no third-party noise; the project's own warning last, once
    assert "\r" not in err, err
    assert "bf16 teacher: 10% (4/40 steps)" in err, err
    assert "QAD: 100% (8/8 steps)" in err, err
    for noise in ("Apex", "GPTModel IS DEPRECATED", "ShardedTensor", "there is no optimizer", "async save",
                  "quantization_config", "Transformer Engine"):
        assert noise not in err, (noise, err)
    assert err.count("saw no calibration tokens") <= 1, err  # rank 0 alone, once (with this seed: experts 0, 2, 5)
    if "saw no calibration tokens" in err:
        assert err.index("\nwarnings (") < err.index("saw no calibration tokens"), err  # last, in the block
    # QAD's outcome said plainly, with its noise: no share of a loss gap that is noise, a worse loss called worse
    assert "held-out KL to the teacher" in printed
    assert re.search(r"(\d+% ± \d+% of the PTQ loss gap \(.*\) closed|no share of it closed is reported|"
                     r"QAD made the held-out loss WORSE)", printed), printed
    assert "imported back bit-exact" in printed
    # what the KL does not show: teacher-forced top-1 agreement and greedy generation, after PTQ and after QAD
    qad_line = next(line for line in printed.splitlines() if line.startswith("[3/6] "))
    assert re.search(r"the teacher's top-1 token at [0-9.]+% -> [0-9.]+% of positions, and greedy generation from "
                     r"\d+ prompts: the teacher's tokens at \d+% -> \d+%, mean length [0-9.]+ -> [0-9.]+ \(teacher "
                     r"[0-9.]+\)", qad_line), qad_line
    # transformers reads the NVFP4 experts through the public fix, and the demo says so
    assert "with modelopt_moe.export.transformers_compat.fix_nvfp4_experts() applied" in printed
    # both exports checked against the engines' loader contracts, one verdict line each in the export stage
    export_line = next(line for line in printed.splitlines() if line.startswith("[5/6] "))
    for fmt in ("compressed-tensors", "modelopt"):
        assert re.search(rf"check vllm PASS, sglang PASS, trtllm PASS \({fmt}: \d+ ", export_line), export_line
    assert "logits bit-identical" in printed
    assert "every weight and amax bit-identical" in printed

    run = json.loads((out / "run.json").read_text())
    losses = run["losses"]
    for key in ("bf16 teacher (held out)", "PTQ (held out)", "QAD (held out)", "KL to teacher after PTQ",
                "KL to teacher after QAD"):
        assert math.isfinite(losses[key]), (key, losses)
    # per-batch held-out numbers, the noise behind every comparison
    assert [len(run["eval"][m]["loss"]) for m in ("bf16 teacher", "PTQ", "QAD")] == [4, 4, 4]
    assert run["outcome"]["verdict"] in ("better", "worse", "within noise")
    assert all(0.0 <= x <= 1.0 for m in ("PTQ", "QAD") for x in run["eval"][m]["top1"]), run["eval"]
    assert [len(run["eval"][m]["top1"]) for m in ("PTQ", "QAD")] == [4, 4]
    gen = run["generation"]
    assert (gen["prompt tokens"], gen["new tokens"], gen["end token"]) == (16, 16, 10)
    assert list(gen["models"]) == ["bf16 teacher", "PTQ", "QAD"]
    assert gen["models"]["bf16 teacher"]["same tokens as the reference"] == 1.0
    for g in gen["models"].values():
        assert 1 <= g["mean length"] <= 16, gen
        assert 0.0 <= g["end rate"] <= 1.0, gen
        assert 0.0 <= g["same tokens as the reference"] <= 1.0, gen
    assert run["outcome"]["gap_noise"] > 0
    # QAD lowers the KL it minimises (on its own batches; the held-out KL of this short run is only reported)
    assert losses["KL to teacher on QAD data, after QAD"] < losses["KL to teacher on QAD data, after PTQ"], losses
    # stages 4 and 5 give the typical difference and the top-1 agreement beside the max, and the measured source;
    # measured on this run: max 0.31 / 0.34 (at the 1-2 of 256 tokens where bf16 rounding flips a near-tied expert
    # choice), mean 0.0024 / 0.0022 on logits up to 4, top-1 100% / 100% (a wrong scale moves all three)
    figures = (r"(logits|weight-only forward:) max \|diff\| [0-9.e-]+, mean \|diff\| [0-9.e-]+ on logits up to "
               r"[0-9.e+]+ \(bf16\), the same top-1 token at [0-9.]+% of positions \(bf16 rounding")
    for i in (4, 5):
        line = next(line for line in printed.splitlines() if line.startswith(f"[{i}/6] "))
        assert re.search(figures, line), line
        assert "the max sits at tokens where it flips a near-tied expert choice" in line, line
    moved = {k: losses[f"checkpoint at another layout: logits {k}"] for k in ("max |diff|", "mean |diff|",
                                                                               "same top-1 token")}
    assert moved["max |diff|"] < 1.0, moved
    assert moved["mean |diff|"] < 0.02, moved
    assert moved["same top-1 token"] >= 0.97, moved
    # transformers reads the compressed-tensors export; its logits agree with the Megatron model's up to bf16
    # rounding in another order of operations
    assert losses["transformers vs Megatron logits (max |diff|)"] < 0.5, losses
    assert losses["transformers vs Megatron logits (mean |diff|)"] < 0.02, losses
    assert losses["transformers vs Megatron: same top-1 token"] >= 0.97, losses
    for name in ("hf_compressed_tensors", "hf_modelopt"):
        assert (out / "artifacts" / name / "config.json").is_file()
    # the model card of the compressed-tensors export tells its reader about the transformers fix
    assert "transformers_compat.fix_nvfp4_experts()" in (out / "artifacts" / "hf_compressed_tensors" / "README.md"
                                                         ).read_text()
    curves = run["curves"]
    assert len(curves["bf16 teacher training"]) == 40
    assert len(curves["QAD (KL to the teacher)"]) == 8
    assert all(math.isfinite(loss) for c in curves.values() for _, loss in c)

    report = (out / "report.md").read_text()
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["expert_input_amax.png", "expert_weight_amax.png", "expert_weight_error.png", "loss_curve.png"]
    for png in pngs:
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (out / png).stat().st_size > 10_000
        assert f"({png})" in report
    # the quantizer summary lists every expert under its global index, from rank 0, and says so
    assert re.search(" ".join(rf"{e}:[0-9.]+" for e in range(8)), report), report
    assert "every rank's experts" in report
    assert "## Held out (4 batches; mean ± standard error over them)" in report
    assert "| KL to the teacher | the teacher's top-1 token (% of positions) |" in report
    assert f"## Greedy generation ({gen['prompts']} held-out prompts of 16 tokens, up to 16 new tokens" in report
    for m in ("bf16 teacher", "PTQ", "QAD"):
        assert re.search(rf"^\| {m} \| [0-9.]+% \| \d+% \| [0-9.]+ \|$", report, re.M), report

    # `modelopt-moe report` renders the same report again from run.json
    again = tmp_path / "again"
    assert main(["report", "--run", str(out / "run.json"), "--out", str(again)]) == 0
    assert (again / "report.md").read_text() == report
    assert sorted(p.name for p in again.glob("*.png")) == pngs


def _demo_subprocess(args, tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "modelopt_moe.plugins.cli", "demo", *args], env=env,
                          capture_output=True, text=True, timeout=seconds(600), cwd=tmp_path)


# The smallest run that still passes every stage: one process (gpt-oss: SequentialMLP experts with biases at
# expert-parallel size 1), two bf16 steps, one QAD step, one calibration batch, two held-out batches.
_ONE_PROCESS = ["--world-size", "1", "--tp", "1", "--ep", "1"]
_FAMILY_LAYOUTS = {"qwen3_moe": _ONE_PROCESS, "deepseek_v3": _ONE_PROCESS, "glm4_moe": _ONE_PROCESS,
                   "gpt_oss": _ONE_PROCESS, "qwen3_5_moe": _ONE_PROCESS}
_ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                  "glm4_moe": "Glm4MoeForCausalLM", "gpt_oss": "GptOssForCausalLM",
                  "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}


@pytest.mark.parametrize("model", sorted(_FAMILY_LAYOUTS))
def test_demo_runs_every_family_from_the_command_line(model, tmp_path):
    out = tmp_path / "report"
    flags = [] if model == "qwen3_moe" else ["--model", model]  # qwen3_moe is the default
    done = _demo_subprocess([*flags, *_FAMILY_LAYOUTS[model], "--train-steps", "2", "--steps", "1", "--seq-len", "16",
                             "--batch-size", "2", "--num-calib-batches", "1", "--num-eval-batches", "2", "--out",
                             str(out)], tmp_path)
    printed = done.stdout
    assert done.returncode == 0, printed + done.stderr[-3000:]
    assert printed.splitlines()[0].endswith(f"; {model} model ({model}_tiny.json), nvfp4 experts "
                                            "(nvfp4_experts.yaml)"), printed
    for i in range(1, 7):
        assert printed.count(f"[{i}/6] ") == 1, printed
    assert "imported back bit-exact" in printed, printed
    assert "logits bit-identical" in printed, printed
    assert "every weight and amax bit-identical" in printed, printed
    run = json.loads((out / "run.json").read_text())
    assert run["setup"][0].startswith(f"model: {model}_tiny.json ({_ARCHITECTURES[model]}: "), run["setup"]
    assert all(math.isfinite(run["losses"][k]) for k in ("bf16 teacher (held out)", "PTQ (held out)",
                                                         "QAD (held out)")), run["losses"]
    export_line = next(line for line in printed.splitlines() if line.startswith("[5/6] "))
    if model == "gpt_oss":  # its experts are stored fused: quantized, they export only as MXFP4, and it says so
        assert export_line.startswith("[5/6] export: not written: gpt_oss stores its experts fused as 3-D tensors "
                                      "(model.layers.0.mlp.experts.gate_up_proj, model.layers.0.mlp.experts."
                                      "down_proj), and quantized fused experts export only as MXFP4 weights in the "
                                      "published layout (format='hf-mxfp4'"), export_line
        assert not (out / "artifacts" / "hf_compressed_tensors").exists()
        return
    for fmt in ("compressed-tensors", "modelopt"):
        assert re.search(rf"check vllm PASS, sglang PASS, trtllm PASS \({fmt}: \d+ ", export_line), export_line
    for name in ("hf_compressed_tensors", "hf_modelopt"):
        cfg = json.loads((out / "artifacts" / name / "config.json").read_text())
        assert cfg["architectures"] == [_ARCHITECTURES[model]], cfg
    assert math.isfinite(run["losses"]["transformers vs Megatron logits (max |diff|)"]), run["losses"]


def test_demo_lists_the_shipped_families(capsys):
    with pytest.raises(SystemExit) as info:
        main(["demo", "--model", "llama"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--model: invalid choice: 'llama'" in err, err
    families = ("deepseek_v3", "glm4_moe", "gpt_oss", "qwen3_5_moe", "qwen3_moe")
    assert all(f"'{family}'" in err for family in families), err
