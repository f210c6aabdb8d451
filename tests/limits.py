"""Time limits of the test suite, scaled for slow machines.

A limit is about ten times what the work takes on two idle cores: generous enough that a machine under load does not
fail a test, short enough that a hang still fails it. ``MODELOPT_MOE_TEST_TIME_SCALE`` (default 1) multiplies every
limit on a machine slower than that.
"""

import os


def seconds(limit: float) -> float:
    """``limit`` seconds times ``$MODELOPT_MOE_TEST_TIME_SCALE``."""
    return limit * float(os.environ.get("MODELOPT_MOE_TEST_TIME_SCALE", "1"))
