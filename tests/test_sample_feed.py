"""The trainer's sample feed: whole groups in stream order, stale groups replaced whole, the actor told when more
are needed, incomplete groups dropped, and resume by count."""

import threading
from collections import Counter

import pytest

from pipelinerl.config import load_config
from pipelinerl.samples import Sample
from pipelinerl.streams import open_writer
from pipelinerl.train import SampleFeed

G = 2  # sampling.group_size in these tests


def sample(group: str, version: int) -> dict:
    return Sample(group_id=group, prompt_token_ids=[1], output_token_ids=[2, 3], behav_logprobs=[-0.1, -0.2],
                  versions=[version, version + 1], finish_reason="stop").model_dump()


def group(name: str, *versions: int) -> list[dict]:
    return [sample(name, v) for v in versions]


def setup(tmp_path, group_size: int = G):
    cfg = load_config(None, [f"run_dir={tmp_path}", "model.path=unused", f"sampling.group_size={group_size}",
                             "trainer.samples_per_step=6"])
    return cfg, open_writer(cfg.streams, tmp_path, "samples", "actor")


def ids(batch: list[Sample]) -> list[str]:
    return [s.group_id for s in batch]


def assert_whole_groups(batch: list[Sample], group_size: int = G) -> None:
    assert all(count == group_size for count in Counter(ids(batch)).values()), ids(batch)


def test_a_stale_group_is_dropped_whole_and_replaced_by_whole_groups(tmp_path):
    cfg, writer = setup(tmp_path)
    # at version 5 with max_lag 2: g1 is stale through one sample only (first token at 2), g2 through both
    for g in (group("g0", 5, 4), group("g1", 5, 2), group("g2", 1, 1)):
        writer.write_many(g)  # the actor writes a group in one append
    feed = SampleFeed(cfg, skip=0)
    heard = []

    def on_dropped(taken):
        # the actor learns how many samples the trainer took, and how many of them are in this step's batch, and
        # produces a replacement
        heard.append((feed.consumed, taken))
        if len(heard) == 2:
            writer.write_many(group("g3", 4, 4))

    batch, dropped = feed.take_fresh(4, version=5, max_lag=2, on_dropped=on_dropped)
    assert ids(batch) == ["g0", "g0", "g3", "g3"]  # g1's young sample went with its group
    assert dropped == 4 and heard == [(4, 2), (6, 2)] and feed.consumed == 8
    assert_whole_groups(batch)
    with pytest.raises(ValueError, match="sampling.group_size"):
        feed.take_fresh(3, version=5, max_lag=2)


def test_no_group_is_split_across_two_steps(tmp_path):
    """Replacing a stale sample by the next one in the stream would start the next group in this step; here every
    step holds whole groups, and a group whose samples are still arriving is waited for, not cut."""
    cfg, writer = setup(tmp_path, group_size=3)
    for g in (group("g0", 0, 5, 5), group("g1", 5, 5, 5), group("g2", 5, 5, 5)):
        writer.write_many(g)
    writer.write_many(group("g3", 5, 5))  # a reader can see part of an append: g3's last sample comes later
    feed = SampleFeed(cfg, skip=0)
    first, dropped = feed.take_fresh(6, version=5, max_lag=2)
    assert ids(first) == ["g1"] * 3 + ["g2"] * 3 and dropped == 3
    late = threading.Timer(0.3, writer.write, args=(sample("g3", 5),))
    late.start()
    try:
        second, _ = feed.take_fresh(3, version=5, max_lag=2)
    finally:
        late.join()
    assert ids(second) == ["g3"] * 3
    assert not set(ids(first)) & set(ids(second))
    assert_whole_groups(first, 3)
    assert_whole_groups(second, 3)


def test_incomplete_groups_are_dropped_and_resume_continues_at_a_group(tmp_path):
    cfg, writer = setup(tmp_path)
    writer.write_many([sample("torn", 5)])  # one of two samples, then another group: a torn write
    writer.write_many(group("g1", 5, 5))
    writer.write_many(group("g2", 5, 5))
    feed = SampleFeed(cfg, skip=0)
    batch, dropped = feed.take_fresh(2, version=5, max_lag=2)
    assert ids(batch) == ["g1", "g1"] and dropped == 1 and feed.incomplete == 1 and feed.consumed == 3
    # resuming after 3 consumed samples starts at the next group
    resumed = SampleFeed(cfg, skip=feed.consumed)
    assert ids(resumed.take_fresh(2, version=5, max_lag=2)[0]) == ["g2", "g2"]
    # a count from mid-group (a checkpoint from before groups were kept whole): the rest of it is dropped
    writer.write_many(group("g3", 5, 5))
    mid = SampleFeed(cfg, skip=4)
    batch, dropped = mid.take_fresh(2, version=5, max_lag=2)
    assert ids(batch) == ["g3", "g3"] and dropped == 1 and mid.consumed == 7
