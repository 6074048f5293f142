"""A correct verifier that takes its time: held-out evaluation with it outlasts a short collective timeout
(tests/test_trainer_ranks.py). `SLOW_REWARD_S` seconds per answer."""

import os
import time

from pipelinerl.tasks.arithmetic import score_arithmetic


def score(item: dict):
    time.sleep(float(os.environ.get("SLOW_REWARD_S", "1.0")))
    return score_arithmetic(item)
