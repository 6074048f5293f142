"""The trainer's sample feed: stream order, stale samples replaced, and the actor told when more are needed."""

from pipelinerl.config import load_config
from pipelinerl.samples import Sample
from pipelinerl.streams import open_writer
from pipelinerl.train import SampleFeed


def sample(i: int, version: int) -> dict:
    return Sample(group_id=f"g{i}", prompt_token_ids=[1], output_token_ids=[2, 3], behav_logprobs=[-0.1, -0.2],
                  versions=[version, version], finish_reason="stop").model_dump()


def test_stale_samples_are_replaced_and_the_actor_hears_before_the_trainer_waits(tmp_path):
    cfg = load_config(None, [f"run_dir={tmp_path}", "model.path=unused"])
    writer = open_writer(cfg.streams, tmp_path, "samples", "actor")
    writer.write_many([sample(0, 5), sample(1, 2), sample(2, 1), sample(3, 5)])  # at version 5, max_lag 2
    feed = SampleFeed(cfg, skip=0)
    heard = []

    def on_dropped():
        # the actor learns how many samples the trainer took and produces the missing one
        heard.append(feed.consumed)
        writer.write(sample(4, 4))

    batch, dropped = feed.take_fresh(3, version=5, max_lag=2, on_dropped=on_dropped)
    assert [s.group_id for s in batch] == ["g0", "g3", "g4"]
    assert dropped == 2 and heard == [3] and feed.consumed == 5  # told after taking g0..g2
    # resuming after 5 consumed samples starts behind them
    writer.write(sample(5, 5))
    assert [s.group_id for s in SampleFeed(cfg, skip=5).take_available(1)] == ["g5"]
