"""The trainer contract is what the trainer role really calls: a trainer written against
`pipelinerl.contracts.trainer.TrainerBackend` alone (no torch model, no accelerate) runs `train()` end to end,
through a checkpoint, a resume and the final export; and every way the run ends closes it once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipelinerl.config import load_config
from pipelinerl.contracts.trainer import BroadcastStats, TrainerBackend
from pipelinerl.samples import Sample
from pipelinerl.streams import open_reader, open_writer
from pipelinerl.train import train
from pipelinerl.trainer.checkpoint import STATE_FILE, latest_checkpoint

GROUP = 2


class ProtocolOnlyTrainer:
    """Every method of TrainerBackend and nothing else; it 'trains' by counting."""

    def __init__(self, fail_at: int | None = None):
        self._version, self.fail_at = 0, fail_at
        self.calls: list[str] = []
        self.batches: list[list[str]] = []
        self.closed = 0

    @property
    def version(self) -> int:
        return self._version

    @property
    def is_main_process(self) -> bool:
        return True

    processes = 1

    @property
    def num_processes(self) -> int:
        return self.processes

    def any_process(self, *flags: bool) -> list[bool]:
        return list(flags)

    def barrier(self, after: str) -> None:
        self.calls.append("barrier")

    def optimizer_step(self, batch) -> dict[str, float]:
        if self._version + 1 == self.fail_at:
            raise RuntimeError("a trainer bug")
        self.batches.append([s.group_id for s in batch])
        self._version += 1
        return {"loss": 0.5, "contract_batch": float(len(batch))}

    def note_eval_score(self, score: float) -> None:
        self.calls.append("note_eval_score")

    def connect_engines(self, engine_urls, ranks_per_engine: int = 1) -> Any:
        self.calls.append("connect_engines")
        return None

    def ensure_engines(self, group, engine_urls, ranks_per_engine, wait_s, should_stop, force=False):
        self.calls.append("ensure_engines")
        return group, []

    def broadcast_weights(self, group, engine_urls) -> BroadcastStats:
        self.calls.append(f"broadcast {self._version}")
        return BroadcastStats(self._version, 0, 0.0)

    def full_parameters(self):
        return iter(())

    def save_checkpoint(self, ckpt_dir: Path, data_position: dict) -> Path:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        state = {"version": self._version, "step": self._version, "data_position": data_position}
        (ckpt_dir / STATE_FILE).write_text(json.dumps(state))
        return ckpt_dir

    def load_checkpoint(self, ckpt_dir: Path) -> dict:
        state = json.loads((ckpt_dir / STATE_FILE).read_text())
        self._version = state["version"]
        return state["data_position"]

    def export(self, out_dir: Path) -> Path:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "exported").write_text(str(self._version))
        return out_dir

    def close(self) -> None:
        self.closed += 1


def _run(tmp_path: Path, groups: int, *overrides: str):
    cfg = load_config(None, [f"run_dir={tmp_path}", "model.path=unused", f"sampling.group_size={GROUP}",
                             "trainer.samples_per_step=4", "trainer.max_steps=3", "trainer.save_every=2",
                             "trainer.save_every_minutes=0", "trainer.eval_every=0", *overrides])
    writer = open_writer(cfg.streams, tmp_path, "samples", "actor")
    for g in range(groups):
        writer.write_many([Sample(group_id=f"g{g}", prompt_token_ids=[1], output_token_ids=[2, 3],
                                  behav_logprobs=[-0.1, -0.2], versions=[0, 0], reward=1.0,
                                  finish_reason="stop").model_dump() for _ in range(GROUP)])
    return cfg


def test_a_trainer_written_against_the_protocol_alone_runs_the_trainer_role(tmp_path):
    assert isinstance(ProtocolOnlyTrainer(), TrainerBackend)
    cfg = _run(tmp_path, groups=6)
    trainer = ProtocolOnlyTrainer()
    assert train(cfg, "http://127.0.0.1:9", trainer=trainer) == 0
    assert trainer.batches == [["g0", "g0", "g1", "g1"], ["g2", "g2", "g3", "g3"], ["g4", "g4", "g5", "g5"]]
    assert trainer.calls[0] == "connect_engines" and [c for c in trainer.calls if c.startswith("broadcast")] == [
        "broadcast 1", "broadcast 2", "broadcast 3"]
    assert trainer.closed == 1
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "samples" in r] == [1, 2, 3]
    assert all(r["contract_batch"] == 4.0 for r in rows if "samples" in r)  # the trainer's stats, logged
    assert (tmp_path / "final_model" / "exported").read_text() == "3"
    assert latest_checkpoint(tmp_path).name.endswith("3")
    control = [r for r in open_reader(cfg.streams, tmp_path, "control").read()]
    assert control[-1] == {"kind": "done", "version": 3}

    # a longer run resumes from the newest checkpoint, through the contract's load_checkpoint
    for g in range(6, 10):
        open_writer(cfg.streams, tmp_path, "samples", "actor").write_many(
            [Sample(group_id=f"g{g}", prompt_token_ids=[1], output_token_ids=[2], behav_logprobs=[-0.1],
                    versions=[3], reward=0.0, finish_reason="stop").model_dump() for _ in range(GROUP)])
    resumed = ProtocolOnlyTrainer()
    longer = load_config(None, [f"run_dir={tmp_path}", "model.path=unused", f"sampling.group_size={GROUP}",
                                "trainer.samples_per_step=4", "trainer.max_steps=5", "trainer.eval_every=0",
                                "trainer.save_every_minutes=0"])
    assert train(longer, "http://127.0.0.1:9", trainer=resumed) == 0
    assert resumed.batches == [["g6", "g6", "g7", "g7"], ["g8", "g8", "g9", "g9"]] and resumed.closed == 1


def test_an_exception_in_a_step_still_closes_the_trainer_once(tmp_path):
    """Once, only a stop request closed the trainer on its way out; any other exception skipped it."""
    cfg = _run(tmp_path, groups=6)
    trainer = ProtocolOnlyTrainer(fail_at=2)
    with pytest.raises(RuntimeError, match="a trainer bug"):
        train(cfg, "http://127.0.0.1:9", trainer=trainer)
    assert trainer.closed == 1 and trainer.version == 1


@pytest.mark.parametrize("processes", [1, 2])
def test_engines_heard_from_within_a_second_are_not_checked_again_by_one_process(tmp_path, processes):
    """Before a broadcast the engines' health is checked unless every engine answered within the last
    ENGINES_HEARD_WITHIN_S (a broadcast is their answer; on small models a check per step cost a tenth of it):
    three quick steps of one process check once, before the first; several processes check every step (a failed
    broadcast cannot be retried there)."""
    cfg = _run(tmp_path, groups=6)
    trainer = ProtocolOnlyTrainer()
    trainer.processes = processes
    assert train(cfg, "http://127.0.0.1:9", trainer=trainer) == 0
    steps = [c for c in trainer.calls if c.startswith(("ensure", "broadcast"))]
    if processes == 1:
        assert steps == ["ensure_engines", "broadcast 1", "broadcast 2", "broadcast 3"]
    else:
        assert steps == ["ensure_engines", "broadcast 1", "ensure_engines", "broadcast 2", "ensure_engines",
                         "broadcast 3"]


def test_a_stop_while_one_step_off_policy_waits_for_the_next_batch_saves_the_trained_step(tmp_path):
    """actor.one_step_off_policy: after a step the trainer waits for the next batch before sending the weights;
    a stop then records and saves the step it trained (its broadcast skipped), so a rerun redoes nothing."""
    import signal
    import threading

    from pipelinerl.train import StopSignals

    cfg = _run(tmp_path, 3, "actor.max_lag=1", "actor.one_step_off_policy=true")  # three groups: a batch and a half
    trainer, stop = ProtocolOnlyTrainer(), StopSignals()
    timer = threading.Timer(1.5, lambda: setattr(stop, "signum", signal.SIGTERM))
    timer.start()
    try:
        assert train(cfg, "http://127.0.0.1:9", stop=stop, trainer=trainer) == 128 + signal.SIGTERM
    finally:
        timer.cancel()
    assert trainer.batches == [["g0", "g0", "g1", "g1"]]
    assert [c for c in trainer.calls if c.startswith("broadcast")] == []  # the weights wait for the next batch
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "samples" in r] == [1] and rows[-1]["next_batch_wait_s"] >= 1.0
    state = json.loads((latest_checkpoint(tmp_path) / STATE_FILE).read_text())
    assert state["version"] == 1 and state["data_position"]["consumed_samples"] == 4
