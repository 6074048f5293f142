"""The trainer's sample feed: whole groups, the most lagged of the ready ones first, stale groups replaced whole,
the actor told when more are needed, incomplete groups dropped, resume from a position that skips what was
taken, and several trainer processes taking the same groups."""

import threading
import time
from collections import Counter

import pytest

from pipelinerl.config import load_config
from pipelinerl.samples import Sample
from pipelinerl.streams import open_writer
from pipelinerl.train import SampleFeed, StopRequested

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
    feed = SampleFeed(cfg)
    heard = []

    def on_dropped():
        # the actor learns how many samples the trainer took and produces a replacement
        heard.append(feed.consumed)
        writer.write_many(group("g3", 4, 4))

    batch, dropped = feed.take_fresh(4, version=5, max_lag=2, on_dropped=on_dropped)
    assert ids(batch) == ["g0", "g0", "g3", "g3"]  # g1's young sample went with its group
    assert dropped == 4 and heard == [6] and feed.consumed == 8
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
    feed = SampleFeed(cfg)
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
    feed = SampleFeed(cfg)
    batch, dropped = feed.take_fresh(2, version=5, max_lag=2)
    assert ids(batch) == ["g1", "g1"] and dropped == 1 and feed.incomplete == 1 and feed.consumed == 3
    # resuming after 3 consumed samples starts at the next group
    assert feed.position() == {"consumed_samples": 3, "taken_after": [], "samples_taken": 3}
    resumed = SampleFeed(cfg, feed.position())
    assert ids(resumed.take_fresh(2, version=5, max_lag=2)[0]) == ["g2", "g2"]
    # a count from mid-group (a checkpoint from before groups were kept whole): the rest of it is dropped
    writer.write_many(group("g3", 5, 5))
    mid = SampleFeed(cfg, {"consumed_samples": 4})
    batch, dropped = mid.take_fresh(2, version=5, max_lag=2)
    assert ids(batch) == ["g3", "g3"] and dropped == 1 and mid.consumed == 7


def test_the_most_lagged_ready_group_goes_first_and_the_younger_ones_wait_fresh(tmp_path):
    """A group that started a version earlier but finished behind younger ones: in stream order it would wait a
    step behind them and pass max_lag; taken first, nothing is dropped."""
    cfg, writer = setup(tmp_path)
    # version 6, max_lag 1: young0 and young1 started at 6, old at 5 and finished after them
    for g in (group("young0", 6, 6), group("young1", 6, 6), group("old", 5, 6)):
        writer.write_many(g)
    feed = SampleFeed(cfg)
    first, dropped = feed.take_fresh(4, version=6, max_lag=1)
    assert ids(first) == ["young0", "young0", "old", "old"] and dropped == 0  # the batch keeps stream order
    # young1 waited one version and is still fresh
    second, dropped = feed.take_fresh(2, version=7, max_lag=1)
    assert ids(second) == ["young1", "young1"] and dropped == 0
    # taken in stream order, `old` would have waited for the version 7 step and been dropped at lag 2
    assert group("old", 5, 6)[0]["versions"][0] == 5


def test_a_resume_skips_the_groups_taken_past_one_still_waiting(tmp_path):
    """The stream's taken part is no longer a prefix: a checkpoint's position is the first group not taken and
    the ids taken after it; a resume trains every group once and loses none."""
    cfg, writer = setup(tmp_path)
    for g in (group("a", 6, 6), group("b", 6, 6), group("c", 5, 5), group("d", 4, 4), group("e", 6, 6)):
        writer.write_many(g)
    feed = SampleFeed(cfg)
    batch, dropped = feed.take_fresh(4, version=6, max_lag=2)
    assert ids(batch) == ["c", "c", "d", "d"] and dropped == 0  # a, b and e wait
    position = feed.position()
    assert position == {"consumed_samples": 0, "taken_after": ["c", "d"], "samples_taken": 4}
    resumed = SampleFeed(cfg, position)
    assert resumed.consumed == 4
    rest, dropped = resumed.take_fresh(6, version=6, max_lag=2)
    assert ids(rest) == ["a", "a", "b", "b", "e", "e"] and dropped == 0
    assert resumed.position() == {"consumed_samples": 10, "taken_after": [], "samples_taken": 10}
    # a stale group dropped past a waiting one is skipped on resume too, not dropped twice
    for g in (group("f", 6, 6), group("stale", 1, 1), group("g", 6, 6)):
        writer.write_many(g)
    batch, dropped = resumed.take_fresh(2, version=6, max_lag=2)
    assert ids(batch) == ["f", "f"] and dropped == 2 and resumed.take_dropped_groups() == ["stale"]
    again = SampleFeed(cfg, resumed.position())
    assert ids(again.take_fresh(2, version=6, max_lag=2)[0]) == ["g", "g"] and again.take_dropped_groups() == []


def test_processes_that_have_read_less_of_the_stream_take_what_the_main_one_chose_from(tmp_path):
    """Several trainer processes read the same stream at their own pace; each step chooses among as many ready
    groups as the main process has, so all take the same batch."""
    cfg, writer = setup(tmp_path)
    for g in (group("young", 6, 6), group("old", 5, 5)):
        writer.write_many(g)
    main = SampleFeed(cfg)
    assert ids(main.take_fresh(2, version=6, max_lag=1)[0]) == ["old", "old"]
    # another process whose reader has seen only `young` when it asks: the main process chose among 2 groups
    other = SampleFeed(cfg, agree=lambda count: 2)
    original = other.reader.read
    seen = []

    def read_slowly():
        records = list(original())
        if not seen:  # the first read returns only the first group's records
            seen.append(records[2:])
            return records[:2]
        out, seen[:] = seen[0] + records, [[]]
        return out

    other.reader.read = read_slowly
    started = time.monotonic()
    assert ids(other.take_fresh(2, version=6, max_lag=1)[0]) == ["old", "old"]
    assert time.monotonic() - started < 5  # (alone, it would have taken `young`, the one group it had)
    # a stop asked of the main process while it waits for samples stops every process
    stopping = SampleFeed(cfg, {"consumed_samples": 4}, agree=lambda count: -1)
    with pytest.raises(StopRequested):
        stopping.take_fresh(2, version=6, max_lag=1, should_stop=lambda: True)
