"""A verifier that sometimes hangs and sometimes kills its worker, for the reward-service test of a whole run."""

import os
import time

from pipelinerl.tasks.arithmetic import score_arithmetic

_calls = 0


def score(item: dict):
    global _calls
    _calls += 1
    if _calls == 3:
        time.sleep(3600)  # a check that never returns
    if _calls == 5:
        os._exit(1)  # a check that takes its worker down
    return score_arithmetic(item)
