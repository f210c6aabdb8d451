"""The commands' output: known third-party warnings hidden (each listed with why), the project's own and unknown
ones collected once on rank 0 for the end, nothing from other ranks."""

import logging
import warnings

import pytest

from modelopt_moe.plugins.cli.noise import KNOWN_LOGS, KNOWN_WARNINGS, print_warnings, rank_output


def test_every_hidden_message_says_why():
    for known in (*KNOWN_WARNINGS, *KNOWN_LOGS):
        assert len(known.why) > 20, known


def test_rank0_hides_known_warnings_and_collects_the_rest_once(capsys):
    with rank_output(0) as collected:
        for _ in range(3):
            warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
                          UserWarning, stacklevel=1)
            warnings.warn("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning,
                          stacklevel=1)
            warnings.warn("calibrate: these experts saw no calibration tokens", UserWarning, stacklevel=1)
            warnings.warn_explicit("an unknown library notice", DeprecationWarning,
                                   "/venv/lib/python3.11/site-packages/somelib/module.py", 7)
    assert collected == ["modelopt_moe: calibrate: these experts saw no calibration tokens",
                         "somelib: DeprecationWarning: an unknown library notice"]
    assert capsys.readouterr().err == ""  # nothing shown while it runs
    print_warnings(collected)
    err = capsys.readouterr().err
    assert err.startswith("\nwarnings (2):\n")
    assert "calibrate: these experts" in err
    assert err.index("an unknown library notice") < err.index("calibrate: these experts")  # the project's last


def test_other_ranks_show_no_warning_and_no_megatron_notice(capsys):
    with rank_output(1) as collected:
        warnings.warn("calibrate: these experts saw no calibration tokens", UserWarning, stacklevel=1)
        logging.getLogger("megatron.core.models.gpt.gpt_model").warning("some notice")
    assert collected == []
    assert capsys.readouterr().err == ""


def test_rank0_drops_known_megatron_logs_and_repeats(caplog):
    logger = logging.getLogger("megatron.core.models.gpt.gpt_model")
    with caplog.at_level(logging.WARNING), rank_output(0):
        logger.warning("GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes")
        logger.warning("a notice worth reading")
        logger.warning("a notice worth reading")
    assert [r.getMessage() for r in caplog.records] == ["a notice worth reading"]


def test_a_failing_rank_still_shows_what_it_collected(capsys):
    def warn_then_fail():
        warnings.warn("calibrate: no forward_loop given", UserWarning, stacklevel=1)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"), rank_output(0):
        warn_then_fail()
    assert "warnings before the failure (1):" in capsys.readouterr().err
