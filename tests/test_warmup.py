"""The supervised warm-up's length buckets (pipelinerl/models/warmup.py): a batch as wide as its own bucket, every
example as likely as without buckets."""

from pipelinerl.models.warmup import length_buckets


def test_short_and_long_examples_go_to_batches_of_their_own_width():
    lengths = [12] * 60 + [150] * 30 + [40] * 30  # sums, instructions, spellings
    buckets = length_buckets(lengths, batch_size=8)
    assert sorted(i for b in buckets for i in b) == list(range(120))  # each example in one bucket
    assert len({len(b) for b in buckets}) <= 2  # equal shares: a bucket drawn uniformly keeps draws uniform
    widths = [max(lengths[i] for i in b) for b in buckets]
    assert sum(widths) / len(widths) < 0.6 * 150  # against every batch padded to 150
    assert all(len({lengths[i] for i in b}) <= 2 for b in buckets)


def test_examples_of_about_one_length_stay_one_bucket():
    same = [9, 10, 11, 10] * 40
    assert length_buckets(same, batch_size=8) == [sorted(range(160), key=same.__getitem__)]
    assert len(length_buckets([5] * 10 + [50] * 10, batch_size=64)) == 1  # fewer examples than a batch per share
    assert length_buckets([], batch_size=4) == [[]]
