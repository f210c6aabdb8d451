"""How ``modelopt-moe`` chooses its parallel layout from the machine and the flags (a pure function: no GPU
needed to test any GPU count)."""

import pytest

from modelopt_moe.plugins.cli.layout import Layout, LayoutError, choose_layout, visible_gpus

# The demo's model: 8 experts, 2 KV heads, 4 heads, vocabulary 256; sequences of 64 tokens.
DEMO = {"num_experts": 8, "tp_divides": {"--seq-len": 64, "num_key_value_heads": 2, "num_attention_heads": 4,
                                         "vocab_size": 256}}


@pytest.mark.parametrize(("gpus", "want"), [
    (0, (4, 2, 2, False)),  # no GPU: 4 CPU processes
    (1, (1, 1, 1, True)),   # one GPU: one process, nothing to split
    (2, (2, 1, 2, True)),
    (4, (4, 2, 2, True)),
    (8, (8, 2, 4, True)),
])
def test_defaults_fit_the_machine(gpus, want):
    layout = choose_layout(gpus, **DEMO)
    assert (layout.world_size, layout.tp, layout.ep, layout.gpus) == want
    assert layout.chosen == ("--world-size", "--tp", "--ep")
    assert layout.world_size % layout.tp == 0
    assert layout.world_size % layout.ep == 0
    assert 8 % layout.ep == 0
    line = layout.describe()
    assert f"{want[0]} {'GPU' if want[3] else 'CPU'} process" in line
    assert f"TP={want[1]} x EP={want[2]}" in line
    assert ("no GPU visible" if gpus == 0 else f"{gpus} GPU") in line


def test_cpu_flag_and_odd_world_sizes():
    assert choose_layout(8, cpu=True, **DEMO) == Layout(4, 2, 2, False, 8, ("--world-size", "--tp", "--ep"))
    odd = choose_layout(0, world_size=3, **DEMO)  # 3 divides neither the experts nor the heads
    assert (odd.tp, odd.ep) == (1, 1)
    six = choose_layout(0, world_size=6, **DEMO)
    assert (six.tp, six.ep) == (2, 1)  # EP 3 would not divide 8 experts
    odd_seq = choose_layout(0, **{**DEMO, "tp_divides": {"--seq-len": 33}})
    assert odd_seq.tp == 1  # sequence parallelism needs the sequence to split over TP


@pytest.mark.parametrize(("gpus", "flags", "message", "would_run"), [
    (1, {"world_size": 4}, "--world-size 4 needs 4 GPUs (one process each) and this machine shows 1",
     "or add --cpu for 4 CPU processes"),
    (0, {"tp": 3}, "--tp 3 must divide the world size 4", "This would run: --world-size 4 --tp 2 --ep 2"),
    (0, {"ep": 3}, "--ep 3 must divide the world size 4; --ep 3 must divide the model's 8 experts",
     "--tp 2 --ep 2"),
    (0, {"tp": 4}, "num_key_value_heads 2 must be a multiple of --tp 4", "--tp 2 --ep 2"),
    (0, {"world_size": 16, "ep": 16}, "--ep 16 must divide the model's 8 experts", "--world-size 16 --tp 2 --ep 8"),
    (2, {"tp": 2, "ep": 3, "world_size": 2}, "--ep 3 must divide the world size 2", "--world-size 2 --tp 2 --ep 1"),
    (0, {"tp": 0}, "--tp 0 must be >= 1", None),
    (0, {"world_size": -1}, "--world-size -1 must be >= 1", None),
    (0, {"world_size": 2, "launched_world_size": 4}, "the launcher started 4 processes", None),
])
def test_a_layout_that_cannot_run_is_refused_with_one_that_would(gpus, flags, message, would_run):
    with pytest.raises(LayoutError) as info:
        choose_layout(gpus, **DEMO, **flags)
    assert message in str(info.value)
    if would_run is not None:
        assert would_run in str(info.value)


def test_under_a_launcher_its_world_size_wins():
    layout = choose_layout(1, launched_world_size=8, **DEMO)
    assert (layout.world_size, layout.tp, layout.ep, layout.gpus) == (8, 2, 4, True)
    assert choose_layout(0, launched_world_size=2, **DEMO).gpus is False


def test_no_gpu_is_visible_with_cuda_visible_devices_empty(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == 0
