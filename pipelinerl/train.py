"""The trainer role: read scored samples from the stream, take optimizer steps, push weights to the engines.

`python -m pipelinerl.train RUN_DIR/config.yaml --engines URL[,URL]`

Each step takes the next `samples_per_step` samples in stream order as whole groups (the actor writes a group in
one append and `samples_per_step` is a multiple of the group size), drops any group with a sample whose first token
is more than `max_lag` versions old (the whole group, counted and replaced by the next whole group; the actor's
admission control makes this rare), trains, broadcasts the new weights into the running engines, and announces
the new version and the count of samples taken on the control stream (the actor plans its lag from both). With
`trainer.num_processes` > 1 every process reads the same stream and trains on its share of each batch.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path

from omegaconf import OmegaConf

from pipelinerl.config import RunConfig, TrainerConfig, load_config, resolve_for_machine
from pipelinerl.contracts.trainer import BroadcastStats, TrainerBackend
from pipelinerl.engines.client import EngineError
from pipelinerl.metrics import JsonlAppender, MetricsSink, continue_metrics
from pipelinerl.placement import detect_gpus
from pipelinerl.procs import engine_urls as engine_urls_of
from pipelinerl.procs import process_age_s, role_arguments
from pipelinerl.samples import Sample, domain_key
from pipelinerl.streams import PollWait, open_reader, open_writer
from pipelinerl.trainer.checkpoint import checkpoint_dir, latest_checkpoint, prune_checkpoints
from pipelinerl.trainer.publisher import EngineWaitInterrupted
from pipelinerl.weight_sync import WeightSyncError, WeightUpdateGroup

log = logging.getLogger("pipelinerl.train")
AUDIT_FILE = "trained_groups.jsonl"


NON_FINITE_EXIT = 3  # the trainer's exit code after trainer.max_skipped_steps non-finite steps in a row
# One trainer process checks the engines' health before a broadcast only when none was heard from for this long
# (a successful broadcast is every engine answering): on small models a check per step was a tenth of the step
# (bench/step_cost.py), and a broadcast that fails on an engine that died since is retried after the engines
# are waited for (push_recovering). Steps longer than this check every time, as several processes always do
# (they cannot retry).
ENGINES_HEARD_WITHIN_S = 1.0


class NonFiniteSteps(RuntimeError):
    """Too many steps in a row had a non-finite loss or gradient norm: each was skipped, weights untouched."""

    def __init__(self, count: int, version: int):
        super().__init__(
            f"{count} steps in a row had a non-finite (NaN/inf) loss or gradient norm and were skipped "
            f"(trainer.max_skipped_steps {count}); the weights are those of version {version}, which the checkpoint "
            "just saved holds. Look at the steps' `loss`/`grad_norm` in metrics.jsonl and the rewards of their "
            "samples; then lower trainer.lr, keep trainer.grad_clip on, or raise trainer.max_skipped_steps, and rerun "
            "the same command to resume")
        self.count, self.version = count, version


class StopRequested(Exception):
    """A stop signal arrived while the trainer waited for samples."""


class StopSignals:
    """SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 (SLURM's warning before pre-emption, `sbatch --signal=USR1@120`)
    ask the trainer to stop: it finishes the step under way, saves a checkpoint and exits with 128 + the
    signal's number, so a scheduler sees a run that did not finish."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self) -> None:
        self.signum: int | None = None

    def install(self) -> StopSignals:
        for signum in self.SIGNALS:
            signal.signal(signum, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without the checkpoint
        self.signum = self.signum or signum  # the first one names the exit code; logged outside the handler

    @property
    def requested(self) -> bool:
        return self.signum is not None


def push_recovering(trainer: TrainerBackend, group: WeightUpdateGroup | None, engine_urls: list[str], cfg: RunConfig,
                    should_stop: Callable[[], bool]) -> tuple[WeightUpdateGroup | None, BroadcastStats, int]:
    """Broadcast the current weights; if that fails because an engine died in the middle (its launcher restarts
    it), wait for it, re-form the group and broadcast again. Returns the group, the broadcast's stats and how
    many engines rejoined. A trainer of several processes cannot retry (its ranks gather the parameters
    together): there the failure stops the run, resumable from the last checkpoint."""
    try:
        return group, trainer.broadcast_weights(group, engine_urls), 0
    except (WeightSyncError, EngineError, OSError) as e:
        if trainer.num_processes > 1:
            raise
        log.warning("the weight broadcast failed (%s: %s); waiting for the engines, then trying again",
                    type(e).__name__, e)
    group, came_back = trainer.ensure_engines(group, engine_urls, cfg.engine.tensor_parallel_size,
                                              cfg.engine.restart_wait_s, should_stop, force=True)
    return group, trainer.broadcast_weights(group, engine_urls), max(1, len(came_back))


class Checkpoints:
    """When to save: every `trainer.save_every` steps, every `trainer.save_every_minutes`, on a stop and at the
    end; pruned to the newest `trainer.keep_checkpoints`. With several trainer processes they agree (one small
    all-reduce per step) so that all save, or stop, at the same step."""

    def __init__(self, trainer: TrainerBackend, cfg: TrainerConfig, run_dir: Path, saved_version: int):
        self.trainer, self.run_dir, self.cfg = trainer, run_dir, cfg
        self.saved_version = saved_version
        self.last_save = time.monotonic()
        self.failures = 0  # periodic saves given up for a full disk

    def decide(self, stop_requested: bool) -> tuple[bool, bool]:
        """(save now, stop now) after a step, agreed by every trainer process."""
        c, version = self.cfg, self.trainer.version
        by_steps = bool(c.save_every) and version % c.save_every == 0
        by_time = bool(c.save_every_minutes) and time.monotonic() - self.last_save >= 60 * c.save_every_minutes
        return tuple(self.trainer.any_process(by_steps or by_time, stop_requested))

    def save(self, position: dict, periodic: bool = False) -> None:
        """Save unless this version is saved already. A periodic save that finds the disk full (ENOSPC, EDQUOT) with
        one trainer process is given up, its partial directory removed, and the run goes on: the newest complete
        checkpoint stays what a resume takes, and the next save is tried at the next interval. The save at a stop
        or at the end raises, as do sharded trainers' (whose ranks would not agree on what was written)."""
        if self.saved_version == self.trainer.version:
            return
        target = checkpoint_dir(self.run_dir, self.trainer.version)
        try:
            self.trainer.save_checkpoint(target, position)
        except Exception as e:  # noqa: BLE001 (savers report a full disk in their own words: see disk_full)
            partial = target.parent / f".tmp-{target.name}"
            if not periodic or self.trainer.num_processes > 1 or not disk_full(e, partial):
                raise
            shutil.rmtree(partial, ignore_errors=True)
            self.failures += 1
            self.last_save = time.monotonic()
            newest = latest_checkpoint(self.run_dir)
            log.error("the checkpoint at version %d could not be written (No space left on device: %s); training "
                      "goes on and the newest complete checkpoint (%s) stays the one a rerun resumes from: free space "
                      "in %s", self.trainer.version, str(e).splitlines()[0] if str(e) else type(e).__name__,
                      newest or "none", target.parent)
            return
        self.saved_version, self.last_save = self.trainer.version, time.monotonic()
        if self.trainer.is_main_process:
            for old in prune_checkpoints(self.run_dir, self.cfg.keep_checkpoints):
                log.info("deleted checkpoint %s (trainer.keep_checkpoints=%d)", old, self.cfg.keep_checkpoints)


def disk_full(error: BaseException, partial: Path) -> bool:
    """Whether a save failed for want of space: an OSError of ENOSPC or EDQUOT anywhere in its chain, or (the
    savers word it their own ways: safetensors' "No space left on device (os error 28)", torch's "file write
    failed") a filesystem left with less room than the partial save had already taken."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(seen) or "Disk quota exceeded" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        written = sum(f.stat().st_size for f in partial.rglob("*") if f.is_file())
        return shutil.disk_usage(partial.parent).free < max(written, 1 << 20)
    except OSError:
        return False


class SampleFeed:
    """Whole groups of samples in stream order, resumable by a count of samples.

    A group is the `sampling.group_size` samples of one prompt, written by the actor in one append, so they are
    contiguous in the stream and share a `group_id`. The feed hands out only whole groups, so a group is never
    split across two steps (a split would give each part its own partial baseline, and a lone sample an advantage
    of 0). A group that cannot be whole, fewer samples of one `group_id` followed by another (a torn write of a
    crashed actor, or a resume from a checkpoint taken mid-group before groups were kept whole), is dropped,
    counted in `incomplete` and logged.
    """

    def __init__(self, cfg: RunConfig, skip: int):
        self.reader = open_reader(cfg.streams, cfg.run_dir, "samples")
        self.group_size = cfg.sampling.group_size
        self.buffer: deque[dict] = deque()
        self.consumed = 0  # samples taken from the stream: trained on, dropped as stale or as incomplete groups
        self.incomplete = 0  # samples dropped in incomplete groups
        self.dropped_groups: list[str] = []  # ids of groups dropped (stale or incomplete) since last asked
        while self.consumed < skip:  # resume: the first `skip` samples were trained on before
            self._fill(block=True)
            while self.buffer and self.consumed < skip:
                self.buffer.popleft()
                self.consumed += 1

    def _fill(self, block: bool) -> None:
        wait = PollWait()
        while True:
            self.buffer.extend(self.reader.read())
            if self.buffer or not block:
                return
            wait.sleep()

    def take_fresh(self, n: int, version: int, max_lag: int, on_dropped: Callable[[int], None] = lambda taken: None,
                   should_stop: Callable[[], bool] = lambda: False) -> tuple[list[Sample], int]:
        """The next `n` samples (`n / group_size` whole groups) at most `max_lag` versions behind `version`, and
        how many samples were dropped on the way.

        A group is stale when any of its samples is: its lag is its oldest sample's `Sample.lag` (versions
        between `version` and that sample's first token), the actor's own measure when it plans lag. A stale
        group is dropped whole and replaced by the next whole group in the stream, so every step trains on a full
        batch of whole groups (a group that finished late, behind younger ones, can be older than the actor
        planned). Incomplete groups dropped on the way count as dropped too.

        `on_dropped(taken)` runs before waiting for replacements, with the fresh samples this batch has so far: the
        actor plans from the count of samples taken, and must hear that more are needed or it would wait for the
        trainer while the trainer waits for it; and that `taken` of them are this version's batch, so that the
        samples it has queued fill the rest of it first.
        `should_stop` is asked while waiting: when it says yes, `StopRequested` is raised (the samples this call
        took are lost to this process, not to the run: a resume reads on from the checkpoint's position)."""
        if n % self.group_size:
            raise ValueError(f"take_fresh takes whole groups: {n} samples is not a multiple of sampling.group_size="
                             f"{self.group_size} (trainer.samples_per_step must be one)")
        fresh: list[Sample] = []
        dropped = 0
        while len(fresh) < n:
            incomplete_before = self.incomplete
            groups = self.take_groups((n - len(fresh)) // self.group_size, should_stop)
            dropped_now = self.incomplete - incomplete_before
            for group in groups:
                if max(s.lag(version) for s in group) > max_lag:
                    dropped_now += len(group)
                    self.dropped_groups.append(group[0].group_id)
                else:
                    fresh += group
            dropped += dropped_now
            if dropped_now and len(fresh) < n:
                on_dropped(len(fresh))
        return fresh, dropped

    def _poll(self, done: Callable[[], bool], should_stop: Callable[[], bool]) -> None:
        """Read the stream until `done()` says so after a read; raises `StopRequested` when `should_stop` does."""
        wait = PollWait()
        while True:
            self._fill(block=False)
            if done():
                return
            if should_stop():
                raise StopRequested
            wait.sleep()

    def wait_until_buffered(self, n: int, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Return once at least `n` samples are in the stream after those taken (raises `StopRequested` when
        `should_stop` says so meanwhile)."""
        self._poll(lambda: len(self.buffer) >= n, should_stop)

    def take_groups(self, max_groups: int, should_stop: Callable[[], bool] = lambda: False) -> list[list[Sample]]:
        """Up to `max_groups` whole groups: those complete in the stream now, or (if none) the first to complete."""
        groups: list[list[Sample]] = []

        def taken() -> bool:
            while len(groups) < max_groups and (group := self._pop_group()) is not None:
                groups.append([Sample.model_validate(record) for record in group])
            return bool(groups) or max_groups <= 0

        self._poll(taken, should_stop)
        return groups

    def take_dropped_groups(self) -> list[str]:
        """The ids of the groups dropped since the last call."""
        out, self.dropped_groups = self.dropped_groups, []
        return out

    def _pop_group(self) -> list[dict] | None:
        """The buffer's first group if all its samples are there, dropping incomplete groups before it; None
        while the rest of the first group has not arrived."""
        while self.buffer:
            group_id = self.buffer[0]["group_id"]
            size = 1
            while size < min(self.group_size, len(self.buffer)) and self.buffer[size]["group_id"] == group_id:
                size += 1
            if size == self.group_size:
                self.consumed += size
                return [self.buffer.popleft() for _ in range(size)]
            if size == len(self.buffer):
                return None  # the group's other samples are still on their way
            for _ in range(size):  # another group starts before this one is whole
                self.buffer.popleft()
            self.dropped_groups.append(group_id)
            self.consumed += size
            self.incomplete += size
            log.warning("dropped incomplete group %s: %d of sampling.group_size=%d samples, then group %s begins (a "
                        "torn write from a crashed actor, or a checkpoint taken mid-group)", group_id, size,
                        self.group_size, self.buffer[0]["group_id"])
        return None


def batch_metrics(batch: list[Sample], trained_at: int | None = None) -> dict[str, float]:
    """The batch's own numbers, overall and per domain (`domain_<name>_*`); with `trained_at` (the trainer's version
    the batch was trained at) each domain's staleness too."""
    n = max(1, len(batch))
    row = {
        "reward_mean": sum(s.reward for s in batch) / n,
        "accuracy": sum(s.reward_parts.get("correct", 0.0) for s in batch) / n,
        "output_tokens_mean": sum(len(s.output_token_ids) for s in batch) / n,
        "truncated_frac": sum(s.finish_reason == "length" for s in batch) / n,
        "mixed_version_frac": sum(len(set(s.model_versions)) > 1 for s in batch) / n,
    }
    groups = {s.group_id: s.timings for s in batch if "generate_s" in s.timings}
    if groups:  # the actor's time per group: the engine's round trip (generation), then the reward pool's
        row["group_generate_s_mean"] = sum(t["generate_s"] for t in groups.values()) / len(groups)
        row["group_reward_s_mean"] = sum(t.get("reward_s", 0.0) for t in groups.values()) / len(groups)
    domains = sorted({s.domain for s in batch if s.domain})
    for domain in domains:  # each domain's numbers apart, never blended into another's
        mine = [s for s in batch if s.domain == domain]
        key = domain_key(domain)
        row[f"domain_{key}_samples"] = float(len(mine))
        row[f"domain_{key}_reward_mean"] = sum(s.reward for s in mine) / len(mine)
        row[f"domain_{key}_accuracy"] = sum(s.reward_parts.get("correct", 0.0) for s in mine) / len(mine)
        row[f"domain_{key}_output_tokens_mean"] = sum(len(s.output_token_ids) for s in mine) / len(mine)
        row[f"domain_{key}_truncated_frac"] = sum(s.finish_reason == "length" for s in mine) / len(mine)
        if trained_at is not None:
            row[f"domain_{key}_lag_mean"] = sum(s.lag(trained_at) for s in mine) / len(mine)
    if any(s.output_mask for s in batch):  # multi-turn samples: how much the model used its tools
        row["tool_calls_mean"] = sum(s.timings.get("tool_calls", 0.0) for s in batch) / n
        row["tool_tokens_frac"] = sum(len(s.output_mask) - sum(s.output_mask) for s in batch) / max(
            1, sum(len(s.output_token_ids) for s in batch))
    return row


def train(cfg: RunConfig, engines: str, stop: StopSignals | None = None,
          trainer: TrainerBackend | None = None) -> int:
    """Train until `trainer.max_steps` (returns 0) or until a stop signal (returns 128 + its number), saving a
    checkpoint either way. `engines`: as `--engines` (URLs, or `@FILE` to wait for once the model is loaded).
    `trainer`: any TrainerBackend (pipelinerl.contracts.trainer); the run's Trainer when not given. Whatever ends
    the run, an exception included, closes the evaluator, the weight-update group and the trainer, once each."""
    stop = stop or StopSignals()
    if trainer is None:
        from pipelinerl.trainer import Trainer

        trainer = Trainer(cfg.model.path, cfg.trainer, cfg.weight_sync, cfg.model.dtype, cfg.seed)
    with contextlib.ExitStack() as on_exit:
        on_exit.callback(trainer.close)  # last: the other closers may still use its processes' group
        return _train(cfg, engines, stop, trainer, on_exit)


def _train(cfg: RunConfig, engines: str, stop: StopSignals, trainer: TrainerBackend,
           on_exit: contextlib.ExitStack) -> int:
    """The loop, phase by phase: set up, then per step take a batch, train, publish the weights, record the step,
    evaluate and save when due; then finish. What it opens is closed by `on_exit` whatever ends the run."""
    run = TrainingRun(cfg, stop, trainer, on_exit)
    if not run.setup(engines):
        log.warning("stopped by %s before the engines answered", signal.Signals(stop.signum).name)
        return 128 + stop.signum
    stopped, failure = False, None
    try:
        run.first_evaluation()
        while trainer.version < cfg.trainer.max_steps:
            batch, waited = run.take_batch()
            trained_at = trainer.version  # each sample's lag is counted from the version it is trained at
            stats = trainer.optimizer_step(batch)
            sync, interrupted = run.publish()
            run.record(batch, stats, waited, sync, trained_at)
            if interrupted:
                stopped = True
                break
            run.count_skipped(stats)
            run.evaluate_when_due()
            # the main process pushed the weights to the engines (and maybe evaluated) alone
            trainer.barrier(f"step {trainer.version}'s weight push and held-out evaluation")
            run.step_done()
            stopped = run.save_when_due()  # its time is the next row's checkpoint_s (inside its wait)
            if stopped:
                break
    except StopRequested:
        stopped = True
    except NonFiniteSteps as e:
        failure = e
    return run.finish(stopped, failure)


class TrainingRun:
    """One trainer process's run, owned in one place: what it opened (registered on the caller's ExitStack), where
    the stream stands, and the counters every step's metrics row carries. With several trainer processes every one
    reads the same samples and takes its share of each batch; only the main process writes metrics, announces
    versions and evaluates (it alone talks to the engines)."""

    def __init__(self, cfg: RunConfig, stop: StopSignals, trainer: TrainerBackend, on_exit: contextlib.ExitStack):
        self.cfg, self.stop, self.trainer, self.on_exit = cfg, stop, trainer, on_exit
        self.run_dir = Path(cfg.run_dir)
        self.main = trainer.is_main_process
        self.metrics: MetricsSink | None = None
        self.audit: JsonlAppender | None = None
        self.control = None
        self.group: WeightUpdateGroup | None = None
        self.engine_urls: list[str] = []
        self.stale_dropped = 0
        self.skipped_in_a_row = 0  # steps whose every update was skipped (a non-finite loss or gradient norm)
        self.engines_rejoined = 0  # engines that died, were restarted and rejoined the weight-update group
        self.engines_heard_at = -float("inf")  # the last health check or broadcast that every engine answered
        self.last = time.monotonic()  # the end of the last step (its barrier): a step's rates count from here
        # where a step's time goes (bench/step_cost.py): the last publish, and what the last step did after its
        # metrics row (writing it, an export, an evaluation, the barrier), which no row's own window covers
        self.publish_s = 0.0
        self.next_batch_wait_s = 0.0  # actor.one_step_off_policy: waiting, before a broadcast, for the next batch
        self.recorded_at: float | None = None
        self.after_row_s = 0.0
        self.checkpoint_s = 0.0  # deciding on and saving a periodic checkpoint, after the barrier (in the next wait)

    def should_stop(self) -> bool:
        return self.stop.requested

    # -- setup ------------------------------------------------------------------------------------------------

    def setup(self, engines: str) -> bool:
        """Resume from the newest checkpoint, open the metrics, wait for the engines, form the weight-update group
        and open the control stream. False when a stop signal came before the engines answered."""
        cfg, trainer = self.cfg, self.trainer
        position: dict = {}
        ckpt = latest_checkpoint(self.run_dir)
        if ckpt is not None:
            position = trainer.load_checkpoint(ckpt)
            log.info("resumed from %s at version %d", ckpt, trainer.version)
        if self.main:
            self._open_metrics()
        self.checkpoints = Checkpoints(trainer, cfg.trainer, self.run_dir, saved_version=trainer.version)
        # the launcher starts this process while the engines load their models: the work above overlapped theirs
        ready_s, waited = process_age_s(), time.monotonic()
        engine_urls = engine_urls_of(engines, self.should_stop)
        if engine_urls is None:
            return False
        self.engine_urls = engine_urls
        if ready_s is not None and self.main:
            log.info("set up in %.1f s from the process's start (imports, model, optimizer), then waited %.1f s "
                     "for the engines", ready_s, time.monotonic() - waited)
        # every tensor-parallel worker of an engine is a rank of the weight-update group
        self.group = trainer.connect_engines(engine_urls, ranks_per_engine=cfg.engine.tensor_parallel_size)
        # left before the trainer closes (a group left to interpreter shutdown can abort the process); the group
        # is re-formed when an engine rejoins, so the closer reads the attribute when it runs
        self.on_exit.callback(lambda: self.group.destroy() if self.group is not None else None)
        if trainer.version > 0:  # the engines loaded the base model; give them the resumed weights
            trainer.broadcast_weights(self.group, engine_urls)
        self.control = open_writer(cfg.streams, self.run_dir, "control", "trainer") if self.main else None
        if self.control is not None:
            self.on_exit.callback(self.control.close)
        self.feed = SampleFeed(cfg, position.get("consumed_samples", 0))
        self.announce_version()
        self.stale_dropped = position.get("stale_dropped", 0)
        self.started = time.monotonic() - position.get("elapsed_s", 0.0)
        self.evaluator = HeldOutEval(cfg, engine_urls, enabled=self.main and cfg.trainer.eval_every > 0)
        self.on_exit.callback(self.evaluator.close)
        self.step_position = self.position()  # where the stream stands after the last whole step
        return True

    def _open_metrics(self) -> None:
        # steps after the checkpoint will be redone: their rows go, so every step is in the file once
        version = self.trainer.version
        removed = continue_metrics(self.run_dir, version)
        if removed:
            log.info("metrics.jsonl: removed %d rows of steps after version %d (redone now)", removed, version)
        self.metrics = MetricsSink(self.run_dir, self.cfg.metrics, OmegaConf.to_container(OmegaConf.structured(
            self.cfg)), resume_version=version)
        self.on_exit.callback(self.metrics.close)
        # which groups each step trained on and dropped: a resume can be audited to redo no step twice and lose
        # no group (tests/test_pipeline.py)
        continue_metrics(self.run_dir, version, AUDIT_FILE)
        self.audit = JsonlAppender(self.run_dir / AUDIT_FILE)
        self.on_exit.callback(self.audit.close)

    def first_evaluation(self) -> None:
        if self.evaluator.enabled and self.trainer.version == 0:
            self.evaluate()
        # The other processes wait here, not in the first step's collectives, while the main one connects to the
        # engines and evaluates (longer than any collective timeout that still catches a hang: see ranks.py).
        self.trainer.barrier("connecting to the engines and the first held-out evaluation")
        self.last = time.monotonic()

    def step_done(self) -> None:
        """The step is over (its barrier passed): the next step's rates count from here."""
        self.last = time.monotonic()
        if self.recorded_at is not None:
            self.after_row_s = self.last - self.recorded_at

    # -- a step -----------------------------------------------------------------------------------------------

    def take_batch(self) -> tuple[list[Sample], float]:
        """The next batch of fresh samples, and how long the wait for it took."""
        batch, dropped = self.feed.take_fresh(
            self.cfg.trainer.samples_per_step, self.trainer.version, self.cfg.actor.max_lag,
            on_dropped=lambda taken: self.announce_version(taking=taken), should_stop=self.should_stop)
        self.stale_dropped += dropped
        return batch, time.monotonic() - self.last

    def publish(self) -> tuple[BroadcastStats, bool]:
        """Push the new weights to the engines and announce the version. An engine that died and was restarted
        rejoins first, before the broadcast that gives it the weights; a stop while waiting for it skips the
        broadcast (on every rank: sharded ones gather together), and the step is saved as trained; so does a stop
        while `actor.one_step_off_policy` waits for the next batch before the broadcast. Returns the broadcast's
        stats and whether a stop interrupted it."""
        cfg, trainer = self.cfg, self.trainer
        interrupted = False
        self.next_batch_wait_s = 0.0
        if cfg.actor.one_step_off_policy and trainer.version < cfg.trainer.max_steps:
            # the next batch is being generated by the engines' weights: the new ones go out once it is done
            waiting = time.monotonic()
            try:
                self.feed.wait_until_buffered(cfg.trainer.samples_per_step, self.should_stop)
            except StopRequested:  # the step is trained: recorded and saved as such, its broadcast skipped
                interrupted = True
            self.next_batch_wait_s = time.monotonic() - waiting
        started = time.monotonic()
        if not interrupted and (trainer.num_processes > 1
                                or started - self.engines_heard_at >= ENGINES_HEARD_WITHIN_S):
            try:
                self.group, came_back = trainer.ensure_engines(self.group, self.engine_urls,
                                                               cfg.engine.tensor_parallel_size,
                                                               cfg.engine.restart_wait_s, self.should_stop)
                self.engines_rejoined += len(came_back)
            except EngineWaitInterrupted:
                interrupted = True
        [interrupted] = trainer.any_process(interrupted)  # (ensure_engines is the main process's alone)
        sync = BroadcastStats(trainer.version, 0, 0.0)
        if not interrupted:
            try:
                self.group, sync, rejoined = push_recovering(trainer, self.group, self.engine_urls, cfg,
                                                             self.should_stop)
                self.engines_rejoined += rejoined
            except EngineWaitInterrupted:  # (one trainer process: push_recovering retries only there)
                interrupted = True
        if not interrupted:
            self.engines_heard_at = time.monotonic()
            self.announce_version()
        self.publish_s = time.monotonic() - started
        return sync, interrupted

    def record(self, batch: list[Sample], stats: dict, waited: float, sync: BroadcastStats,
               trained_at: int | None = None) -> None:
        """The step's metrics row and audit line (main process), and an export when one is due."""
        trainer, now = self.trainer, time.monotonic()
        self.recorded_at = now  # the row's own writing (and an export) counts in the next row's after_last_row_s
        tokens = sum(len(s.output_token_ids) for s in batch)
        row = {"step": trainer.version, "time": now - self.started, "samples": len(batch),
               "samples_total": self.feed.consumed,
               "samples_per_s": len(batch) / (now - self.last), "tokens_per_s": tokens / (now - self.last),
               "wait_for_samples_s": waited, "broadcast_s": sync.seconds, "broadcast_bytes": sync.bytes,
               "publish_s": self.publish_s, "next_batch_wait_s": self.next_batch_wait_s,
               "after_last_row_s": self.after_row_s, "checkpoint_s": self.checkpoint_s,
               "stale_dropped": self.stale_dropped, "stream_corrupt": self.feed.reader.corrupt,
               "engines_rejoined": self.engines_rejoined, "checkpoint_failures": self.checkpoints.failures,
               "min_version_in_batch": min(s.oldest_version for s in batch),
               **batch_metrics(batch, trained_at), **stats}
        self.step_position = self.position()
        every = self.cfg.trainer.export_every
        if every and (trainer.version % every == 0 or trainer.version == self.cfg.trainer.max_steps):
            # on the run's clock (later rows' `time`); the actor generates meanwhile, as during an evaluation,
            # but an export takes a small part of a step (`export_s`)
            t = time.monotonic()
            trainer.export(self.run_dir / "exports" / f"step_{trainer.version}")
            row["export_s"] = time.monotonic() - t
        if self.metrics:
            self.metrics.write(row)
            self.audit.write({"step": trainer.version, "trained": sorted({s.group_id for s in batch}),
                              "dropped": self.feed.take_dropped_groups()})

    def count_skipped(self, stats: dict) -> None:
        """Stop the run (NonFiniteSteps) after `trainer.max_skipped_steps` skipped steps in a row. Alike on every
        rank: a step is skipped when the global gradient norm (reduced over them) is not finite."""
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if stats.get("skipped") else 0
        if self.skipped_in_a_row >= self.cfg.trainer.max_skipped_steps:
            raise NonFiniteSteps(self.skipped_in_a_row, self.trainer.version)

    def evaluate_when_due(self) -> None:
        every, version = self.cfg.trainer.eval_every, self.trainer.version
        if self.evaluator.enabled and (version % every == 0 or version == self.cfg.trainer.max_steps):
            self.evaluate()

    def evaluate(self) -> None:
        row = self.evaluator.run(self.trainer.version, time.monotonic() - self.started, self.feed.consumed)
        self.metrics.write(row)
        self.trainer.note_eval_score(row["eval_accuracy"])  # for trainer.ref_reset_patience

    def save_when_due(self) -> bool:
        """Save a periodic checkpoint when one is due; whether to stop now (agreed by every trainer process)."""
        started = time.monotonic()
        save_now, stopped = self.checkpoints.decide(self.stop.requested)
        if save_now and not stopped:
            self.checkpoints.save(self.step_position, periodic=True)
        self.checkpoint_s = time.monotonic() - started
        return stopped

    # -- the end ----------------------------------------------------------------------------------------------

    def finish(self, stopped: bool, failure: NonFiniteSteps | None) -> int:
        """Save the last whole step (samples a stopped step had taken while waiting for more are taken again on
        resume), then export the final model on a finished run. The exit code: 0, 128 + the stop signal, or
        NON_FINITE_EXIT."""
        trainer = self.trainer
        self.checkpoints.save(self.step_position)
        if failure is not None:
            log.error("%s", failure)
            return NON_FINITE_EXIT
        if stopped:
            signum = self.stop.signum or signal.SIGTERM
            log.warning("stopped by %s at version %d of %d: checkpoint saved; rerun the same command to resume",
                        signal.Signals(signum).name, trainer.version, self.cfg.trainer.max_steps)
            return 128 + signum
        trainer.export(self.run_dir / "final_model")
        announce(self.control, {"kind": "done", "version": trainer.version})
        return 0

    def announce_version(self, **extra: int) -> None:
        announce(self.control, {"kind": "version", "version": self.trainer.version, "consumed": self.feed.consumed,
                                **extra})

    def position(self) -> dict:
        return {"consumed_samples": self.feed.consumed, "stale_dropped": self.stale_dropped,
                "elapsed_s": time.monotonic() - self.started}


def announce(control, message: dict) -> None:
    """Tell the actor (and anyone reading the control stream); a no-op on trainer processes other than main."""
    if control is not None:
        control.write(message)


class HeldOutEval:
    """Held-out evaluation through the engines, which hold the trainer's latest weights: per benchmark (one per
    eval source) avg@k and pass@k with k = trainer.eval_k, and their unweighted mean as `eval_accuracy`.
    Sampling is evaluation's own (`eval:`), each unset value taken from training's `sampling:`."""

    def __init__(self, cfg: RunConfig, engine_urls: list[str], enabled: bool):
        self.cfg, self.urls = cfg, engine_urls
        self.enabled = enabled
        if self.enabled:
            from transformers import AutoTokenizer

            from pipelinerl.tasks import task_from_config

            self.task = task_from_config(cfg.task)
            if cfg.task.reward_fn:  # the verifier that replaces the task's in training replaces it here too
                from pipelinerl.rewards.pool import resolve

                self.task.reward_fn = resolve(cfg.task.reward_fn)
            self.problems = self.task.eval_problems()
            self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
            from pipelinerl.rewards import RewardPool
            from pipelinerl.tasks.base import reward_preload

            self.pool = RewardPool(workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s,
                                   memory_limit_mb=cfg.reward.memory_limit_mb,
                                   preload=reward_preload(self.task)).start()

    @staticmethod
    def sampling(cfg: RunConfig) -> dict:
        """evaluate_async's sampling arguments: `eval.<x>` where set, else `sampling.<x>` (top_k, which `eval:`
        does not have, is always training's)."""
        e, s = cfg.eval, cfg.sampling
        return {"temperature": s.temperature if e.temperature is None else e.temperature,
                "top_p": s.top_p if e.top_p is None else e.top_p, "top_k": s.top_k,
                "max_new_tokens": s.max_new_tokens if e.max_new_tokens is None else e.max_new_tokens,
                "stop": list(s.stop if e.stop is None else e.stop)}

    def close(self) -> None:
        if self.enabled:
            self.pool.close()

    def run(self, step: int, elapsed: float, samples_total: int) -> dict:
        import asyncio

        from pipelinerl.eval import evaluate_async, metrics_row, write_results

        t = self.cfg.trainer
        t0 = time.monotonic()
        result = asyncio.run(evaluate_async(self.task, self.problems, self.urls, self.tokenizer, self.pool,
                                            k=t.eval_k, greedy=t.eval_greedy,
                                            max_model_len=self.cfg.engine.max_model_len,
                                            chat_template=self.cfg.model.chat_template, **self.sampling(self.cfg)))
        result["summary"]["seconds"] = round(time.monotonic() - t0, 2)
        write_results(result, Path(self.cfg.run_dir) / "eval", f"step_{step:06d}")
        row = metrics_row(result)
        n = result["summary"]["samples_per_problem"]
        log.info("held-out avg@%d at step %d: %.3f (%s)", n, step, row["eval_accuracy"],
                 ", ".join(f"{b['benchmark']} {b[f'avg@{n}']:.3f}" for b in result["benchmarks"]))
        return {"step": step, "time": elapsed, "samples_total": samples_total, **row,
                "eval_seconds": time.monotonic() - t0}


def nccl_failure_env(run_dir: str | os.PathLike, environ: Mapping[str, str]) -> dict[str, str]:
    """How NCCL failures end a trainer process: the environment variables to set, each under every name torch
    reads for it, leaving out any the user set (in `environ`) under one of its names. See docs/gpu.md.

    - async error handling 3: a collective that fails or outlives `trainer.collective_timeout_s` (the weight-update
      group: `weight_sync.timeout_s`) makes the watchdog log it, naming the group and the operation, and end the
      process; the launcher then stops the run with the trainer log's last lines. (torch 2.13's default already;
      explicit so that the behaviour does not depend on the torch version.)
    - the flight recorder keeps the last 2000 collectives and is dumped on a timeout, one file per rank, into
      RUN_DIR/logs/nccl_trace/rank_<rank> (torch's default place is ~/.cache/torch, off the run directory);
      `torchfrtrace RUN_DIR/logs/nccl_trace --prefix rank_` compares the ranks' last collectives.
    Blocking wait stays off: it would make every collective's wait() hold the host until done, which serialises
    what DeepSpeed overlaps; the watchdog already bounds each collective."""
    trace = str(nccl_trace_dir(run_dir) / "rank_")
    wanted = {
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"): "3",
        ("TORCH_NCCL_DUMP_ON_TIMEOUT",): "1",
        ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"): "2000",
        ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"): trace,
    }
    return {name: value for names, value in wanted.items() if not any(n in environ for n in names) for name in names}


def nccl_trace_dir(run_dir: str | os.PathLike) -> Path:
    """Where the trainer processes' NCCL flight-recorder dumps go (see `nccl_failure_env`)."""
    return Path(run_dir).resolve() / "logs" / "nccl_trace"


def main(argv: list[str] | None = None) -> int:
    args = role_arguments("train", __doc__.splitlines()[0], argv)
    cfg = load_config(args.config)
    # "auto" settings remain only in a config the launcher did not write (it resolves them, for the engines too)
    cfg, _ = resolve_for_machine(cfg, detect_gpus())
    # read by torch when the trainer's process groups are made, so set before any is
    os.environ.update(nccl_failure_env(cfg.run_dir, os.environ))
    nccl_trace_dir(cfg.run_dir).mkdir(parents=True, exist_ok=True)  # torch makes only its default one
    code = train(cfg, args.engines, StopSignals().install())
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        exit_now(code)
    return code


def exit_now(code: int = 0) -> None:
    """End a trainer rank whose work is all done and saved, skipping interpreter teardown: with several ranks
    (DeepSpeed ZeRO-3 over gloo), a rank sometimes aborted there ("terminate called without an active
    exception", about 1 exit in 20-40 on 2 CPU processes, after its checkpoint, export and the final barrier),
    which would make a finished run look failed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    raise SystemExit(main())
