"""The demo CLI (``python -m modelopt_moe``): argument checks, and one small end-to-end run on 2 gloo ranks."""

import re

import pytest

from modelopt_moe.plugins.cli import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tp", "3"], "--tp 3 must be >= 1 and divide --world-size 4"),
        (["--ep", "4", "--num-experts", "6"], "--num-experts 6 must be a multiple of --ep 4"),
        (["--tp", "2", "--seq-len", "33"], "--seq-len 33 must be a multiple of --tp 2"),
    ],
)
def test_demo_rejects_inconsistent_layouts(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_fails_fast_on_a_bad_config(tmp_path, capsys):
    bad = tmp_path / "typo.yaml"
    bad.write_text("algorithmm: max\n")
    assert main(["--config", str(bad)]) == 2
    assert "typo.yaml" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_demo_quantizes_a_megatron_moe_on_two_ranks(capfd):
    # TP=1/EP=2 keeps it to one quick spawn; the default TP=2/EP=2 layout is covered by test_megatron_cpu.py.
    rc = main(["--world-size", "2", "--tp", "1", "--ep", "2", "--train-steps", "2", "--num-calib-batches", "2",
               "--num-eval-batches", "1", "--batch-size", "2", "--seq-len", "32", "--timeout", "240"])
    out = capfd.readouterr().out
    assert rc == 0, out
    assert "quantizers enabled" in out  # mtq.print_quant_summary ran (on rank 0 only)
    assert out.count("quantizers enabled") == 1
    before = float(re.search(r"before quantization: ([0-9.]+)", out).group(1))
    after = float(re.search(r"after  quantization: ([0-9.]+)", out).group(1))
    assert 0 < before < 10 and 0 < after < 10
