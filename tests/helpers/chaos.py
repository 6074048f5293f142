"""A chaos driver for a whole run on this machine (tests/test_chaos.py; `make chaos` for the long version).

It runs `recipes/tiny_cpu.yaml` with two engines and, while it runs, injects faults at random times:
- SIGKILL of an engine (the launcher restarts it), of a reward worker (the pool replaces it), of the actor or of the
  trainer (the run stops naming it; the driver runs the same command again, which resumes);
- SIGSTOP then SIGCONT of an engine or of the actor (a stall of a few seconds);
- a corrupted last record in the sample stream (skipped and counted by its reader);
- a full disk under the run's checkpoints (a tmpfs shrunk to what it holds, grown again a little later): the
  periodic checkpoint is given up, the run goes on, the newest complete checkpoint stays.
At the end it checks the run's invariants: it finished; every step is in the metrics once; every group the
trainer took from the stream was trained on exactly once or dropped as stale, none twice, none lost; the newest
checkpoint loads; after every stop of the launcher, no process of the run is left.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAULTS = ("kill_engine", "stop_engine", "kill_reward_worker", "kill_actor", "kill_trainer", "stop_actor",
          "corrupt_stream", "fill_disk")
STOPS_THE_RUN = {"kill_actor": "actor exited with code -9", "kill_trainer": "trainer exited with code -9"}
CHECKPOINT_FS_MB = 64


@dataclass
class ChaosReport:
    seed: int
    steps: int
    launches: int = 0
    injected: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # invariants broken (empty: survived)
    checkpoints_refused: int = 0  # periodic saves given up on a full disk (in the last launch's trainer log)
    corrupt_counted: int = 0  # corrupt stream records the trainer skipped and counted

    @property
    def survived(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        counts = {f: self.injected.count(f) for f in FAULTS if f in self.injected}
        verdict = "survived" if self.survived else "FAILED: " + "; ".join(self.failures)
        return f"seed {self.seed}: {len(self.injected)} faults {counts}, {self.launches} launches: {verdict}"


def _pids(run_dir: Path) -> dict[str, int]:
    try:
        return json.loads((run_dir / "pids.json").read_text())
    except (OSError, ValueError):
        return {}


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _left_behind(run_dir: Path) -> list[str]:
    done = subprocess.run(["pgrep", "-af", str(run_dir)], capture_output=True, text=True)
    return [line for line in done.stdout.splitlines() if "pgrep" not in line]


def _mount_tmpfs(path: Path, megabytes: float) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(megabytes * 1024)}k", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def _resize_tmpfs(path: Path, kilobytes: int) -> bool:
    """False when the kernel refused the size: tmpfs will not shrink below what it holds, which a save still
    writing can make more than it held a moment ago."""
    return subprocess.run(["mount", "-o", f"remount,size={kilobytes}k", str(path)], capture_output=True).returncode == 0


def _used_kb(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize // 1024


class Chaos:
    def __init__(self, run_dir: Path, seed: int, steps: int, faults: list[str] | None = None,
                 every_s: tuple[float, float] = (3.0, 8.0), timeout_s: float = 900.0):
        self.run_dir, self.rng, self.steps = run_dir, random.Random(seed), steps
        self.report = ChaosReport(seed, steps)
        self.plan = list(faults) if faults is not None else None  # a fixed order, else drawn at random
        self.every_s, self.timeout_s = every_s, timeout_s
        self.disk = _mount_tmpfs(run_dir / "checkpoints", CHECKPOINT_FS_MB)
        self.env = {**os.environ,
                    "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}

    def command(self) -> list[str]:
        return [sys.executable, "-m", "pipelinerl.cli", "run", "recipes/tiny_cpu.yaml", f"run_dir={self.run_dir}",
                "engine.num_engines=2", f"trainer.max_steps={self.steps}", "trainer.save_every=3",
                "trainer.save_every_minutes=0", "trainer.keep_checkpoints=2", "trainer.eval_every=0",
                "actor.dynamic_sampling=false", "model.warmup_steps=0", "reward.workers=2", "actor.max_lag=2"]

    def run(self, max_faults: int) -> ChaosReport:
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                self.report.launches += 1
                proc = subprocess.Popen(self.command(), cwd=ROOT, env=self.env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
                stopped_by = self._inject_while_running(proc, max_faults, deadline)
                out, err = proc.communicate(timeout=300)
                left = _left_behind(self.run_dir)
                if left:
                    self.report.failures.append(f"launch {self.report.launches}: processes left: {left[:3]}")
                if proc.returncode == 0:
                    break
                expected = STOPS_THE_RUN.get(stopped_by or "")
                if expected is None or expected not in err:
                    self.report.failures.append(f"launch {self.report.launches} exited {proc.returncode} after "
                                                f"{stopped_by or 'no fault that stops a run'}: {err[-600:]}")
                    break
                if time.monotonic() > deadline:
                    self.report.failures.append("the run did not finish in time")
                    break
            if self.report.survived:
                self._check_invariants()
        finally:
            if self.disk:
                subprocess.run(["umount", "-l", str(self.run_dir / "checkpoints")], capture_output=True)
        return self.report

    def _step(self) -> int:
        try:
            rows = (self.run_dir / "metrics.jsonl").read_text().splitlines()
            return int(json.loads(rows[-1])["step"]) if rows else 0
        except (OSError, ValueError, KeyError, IndexError):
            return 0

    def _due(self, max_faults: int) -> bool:
        """With a fixed plan, fault k comes once the run passed step (k + 1) / (n + 1) of its steps, so that the
        faults spread over the run whatever its speed (a step takes 50 ms alone, ten times that under load); at
        random, whenever the random wait is over."""
        if self.plan is None:
            return True
        k = len(self.report.injected)
        return self._step() >= (k + 1) * self.steps // (max_faults + 1)

    def _inject_while_running(self, proc: subprocess.Popen, max_faults: int, deadline: float) -> str | None:
        """Faults until the launcher exits; the fault that stopped it, if one did."""
        last = None
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(self.rng.uniform(*self.every_s) if self.plan is None else 0.1)
            if proc.poll() is not None or len(self.report.injected) >= max_faults or not _pids(self.run_dir):
                continue
            if not (self.run_dir / "logs" / "engine_urls").exists() or not self._due(max_faults):
                continue  # not started yet, or not yet this fault's turn
            fault = self.plan.pop(0) if self.plan else (None if self.plan is not None else
                                                        self.rng.choice(FAULTS))
            if fault == "fill_disk" and not self.disk:
                continue  # (no tmpfs here: not root, or no mount)
            if fault is None or (fault == "fill_disk" and not self._far_from_the_end()):
                if fault is not None and self.plan is not None:
                    self.plan.insert(0, fault)
                continue
            if getattr(self, fault)():
                self.report.injected.append(fault)
                last = fault
                if fault in STOPS_THE_RUN:
                    proc.wait(timeout=120)
            elif self.plan is not None:
                self.plan.insert(0, fault)  # not possible now (no reward worker up yet, say): tried again later
        return last

    def _far_from_the_end(self) -> bool:
        """A full disk at the last save (not a periodic one) stops the run, as it should: kept away from it."""
        return self._step() < self.steps - 15

    # --- the faults ----------------------------------------------------------------------------------------------

    def _signal(self, name: str, sig: signal.Signals) -> bool:
        pid = _pids(self.run_dir).get(name)
        if pid is None or not _alive(pid):
            return False
        try:
            os.killpg(pid, sig) if name.startswith("engine") else os.kill(pid, sig)
        except ProcessLookupError:
            return False
        return True

    def kill_engine(self) -> bool:
        return self._signal(self.rng.choice(["engine0", "engine1"]), signal.SIGKILL)

    def stop_engine(self) -> bool:
        name = self.rng.choice(["engine0", "engine1"])
        if not self._signal(name, signal.SIGSTOP):
            return False
        time.sleep(self.rng.uniform(1.0, 3.0))
        return self._signal(name, signal.SIGCONT) or True

    def stop_actor(self) -> bool:
        if not self._signal("actor", signal.SIGSTOP):
            return False
        time.sleep(self.rng.uniform(1.0, 3.0))
        self._signal("actor", signal.SIGCONT)
        return True

    def kill_actor(self) -> bool:
        return self._signal("actor", signal.SIGKILL)

    def kill_trainer(self) -> bool:
        return self._signal("trainer", signal.SIGKILL)

    def kill_reward_worker(self) -> bool:
        actor = _pids(self.run_dir).get("actor")
        workers = []
        for pid in _children(actor) if actor else []:
            try:
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    workers.append(pid)
            except OSError:
                continue
        if not workers:
            return False
        os.kill(self.rng.choice(workers), signal.SIGKILL)
        return True

    def corrupt_stream(self) -> bool:
        files = sorted((self.run_dir / "streams" / "samples").glob("*.jsonl"))
        if not files:
            return False
        with open(files[-1], "ab") as f:  # a torn record, as a writer killed mid-write leaves one
            f.write(b'{"group_id": "torn", "prompt_token_ids": [1, 2' + b"\n")
        return True

    def fill_disk(self) -> bool:
        """Shrink the checkpoints' filesystem to what it holds now: the next save finds it full. Grown again once
        a save was refused (at most 20 s later), as an operator freeing space would."""
        where, log = self.run_dir / "checkpoints", self.run_dir / "logs" / "trainer.log"

        def refused() -> int:
            try:
                return log.read_text(errors="replace").count("could not be written (No space left")
            except OSError:
                return 0

        before = refused()
        if not any(_resize_tmpfs(where, _used_kb(where) + 64) for _ in range(5)):
            return False  # a save kept writing: tried again later
        give_up = time.monotonic() + 20.0
        while refused() == before and time.monotonic() < give_up:
            time.sleep(0.1)
        if not _resize_tmpfs(where, CHECKPOINT_FS_MB * 1024):  # growing is always allowed
            raise RuntimeError(f"could not grow the tmpfs at {where} back to {CHECKPOINT_FS_MB} MB")
        return True

    # --- the invariants ------------------------------------------------------------------------------------------

    def _check_invariants(self) -> None:
        from pipelinerl.config import StreamsConfig
        from pipelinerl.streams import open_reader

        fail = self.report.failures.append
        rows = [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = [r["step"] for r in rows if "samples" in r]
        if steps != list(range(1, self.steps + 1)):
            fail(f"metrics steps {steps[:5]}...{steps[-5:]}: not each step once")
        audit = [json.loads(line) for line in (self.run_dir / "trained_groups.jsonl").read_text().splitlines()]
        trained = [g for row in audit for g in row["trained"]]
        dropped = [g for row in audit for g in row["dropped"]]
        if len(trained) != len(set(trained)):
            fail("a group was trained twice")
        if set(trained) & set(dropped):
            fail("a group was both trained and dropped")
        final = max((self.run_dir / "checkpoints").glob("step_*"), default=None)
        if final is None:
            fail("no checkpoint")
            return
        state = json.loads((final / "trainer_state.json").read_text())
        consumed = state["data_position"]["consumed_samples"]
        records = [r for r in open_reader(StreamsConfig(), self.run_dir, "samples").read()][:consumed]
        if {r["group_id"] for r in records} != set(trained) | set(dropped):
            fail("the groups taken from the stream are not exactly those trained or dropped")
        if state["version"] != self.steps:
            fail(f"the newest checkpoint is at version {state['version']}, not {self.steps}")
        loaded = subprocess.run([sys.executable, "-c", LOAD_CHECKPOINT, str(self.run_dir), str(final)], cwd=ROOT,
                                env=self.env, capture_output=True, text=True, timeout=300)
        if loaded.returncode != 0 or f"version {self.steps}" not in loaded.stdout:
            fail(f"the newest checkpoint does not load: {loaded.stderr[-500:]}")
        if "corrupt_stream" in self.report.injected and not any(r.get("stream_corrupt", 0) for r in rows):
            fail("a corrupted record was never counted")
        log = (self.run_dir / "logs" / "trainer.log").read_text()
        self.report.checkpoints_refused = len(re.findall(r"could not be written \(No space left", log))
        self.report.corrupt_counted = max((r.get("stream_corrupt", 0) for r in rows), default=0)


LOAD_CHECKPOINT = """
import sys
from pipelinerl.config import load_config
from pipelinerl.trainer import Trainer, load_checkpoint
run_dir, ckpt = sys.argv[1], sys.argv[2]
cfg = load_config(f"{run_dir}/config.yaml")
trainer = Trainer(cfg.model.path, cfg.trainer, cfg.weight_sync, cfg.model.dtype, cfg.seed)
load_checkpoint(trainer, ckpt)
print(f"loaded {ckpt}: version {trainer.version}")
"""
