"""A verifier that hangs on some problems and kills its worker on others, for the reward-service test of a
whole run: a quarter of the problems never return, another quarter take the worker down."""

import os
import time

from pipelinerl.tasks.arithmetic import score_arithmetic


def score(item: dict):
    kind = item["problem"]["a"] % 4
    if kind == 0:
        time.sleep(3600)  # a check that never returns
    if kind == 1:
        os._exit(1)  # a check that takes its worker down
    return score_arithmetic(item)
