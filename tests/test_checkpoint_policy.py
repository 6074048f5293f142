"""What a resume keeps: metrics rows of redone steps removed, old checkpoints pruned, progress readable off a
terminal. (The whole path, killing and stopping real runs: tests/test_pipeline.py.)"""

import json

import pytest

from pipelinerl.config import ConfigError, load_config
from pipelinerl.launch import Progress, resumed_version
from pipelinerl.metrics import continue_metrics
from pipelinerl.trainer.checkpoint import prune_checkpoints


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_continue_metrics_drops_the_steps_a_resume_redoes(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "eval_accuracy": 0.1}] + [{"step": s, "loss": s} for s in range(1, 8)]
    rows.append({"step": 5, "eval_accuracy": 0.3})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 8, "lo')  # a torn last line
    assert continue_metrics(tmp_path, 5) == 3  # steps 6, 7 and the torn row
    assert [r["step"] for r in _rows(path)] == [0, 1, 2, 3, 4, 5, 5]
    assert continue_metrics(tmp_path, 5) == 0  # nothing more to remove: the file is left alone
    assert continue_metrics(tmp_path, 0) == 7 and path.read_text() == ""  # no checkpoint: the run starts over
    assert continue_metrics(tmp_path / "nowhere", 3) == 0


def _checkpoint(root, step):
    d = root / "checkpoints" / f"step_{step:08d}"
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"step": step, "version": step}))
    return d


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path):
    for step in (10, 2, 30, 20):
        _checkpoint(tmp_path, step)
    (tmp_path / "checkpoints" / ".tmp-step_00000040").mkdir()  # a save under way
    (tmp_path / "checkpoints" / "notes").mkdir()  # not a checkpoint: left alone
    deleted = prune_checkpoints(tmp_path, keep=2)
    assert sorted(d.name for d in deleted) == ["step_00000002", "step_00000010"]
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert left == [".tmp-step_00000040", "notes", "step_00000020", "step_00000030"]
    assert resumed_version(tmp_path) == 30
    assert prune_checkpoints(tmp_path, keep=0) == []  # 0 keeps all
    assert resumed_version(tmp_path / "empty") == 0


def test_progress_off_a_terminal_is_a_line_every_interval(capsys):
    progress = Progress(max_steps=100, every_s=3600, resumed_at=10, terminal=False)
    row = {"samples_per_s": 12.5, "tokens_per_s": 300.0, "reward_mean": 0.25, "lag_mean": 1.0}
    for step in range(11, 21):
        progress.show({"step": step, **row})
    progress.show({"step": 20, "eval_accuracy": 0.5})
    progress.show({"step": 100, **row})  # the last step is always shown
    progress.close()
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "\r" not in out and len(lines) == 3, out
    assert lines[0].startswith("step 11/100 (11%) | 12.5 samples/s | 300 tok/s | reward 0.250 | lag 1.00")
    assert lines[1] == "step 20: held-out pass@1 0.500" and lines[2].startswith("step 100/100 (100%)")


@pytest.mark.parametrize("override, key", [("trainer.save_every_minutes=-1", "trainer.save_every_minutes"),
                                           ("trainer.keep_checkpoints=-2", "trainer.keep_checkpoints"),
                                           ("metrics.log_every_s=0", "metrics.log_every_s")])
def test_bad_checkpoint_settings_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config("recipes/tiny_cpu.yaml", [override])


def test_checkpoints_by_time_are_on_by_default():
    cfg = load_config("recipes/tiny_cpu.yaml", [])
    assert cfg.trainer.save_every_minutes > 0 and cfg.trainer.keep_checkpoints >= 1
