"""The actor role: keeps every engine busy, scores finished groups, and streams them to the trainer.

`python -m pipelinerl.actor RUN_DIR/config.yaml --engines URL[,URL]`

Flow: a train problem -> one /v1/generate with n = group_size on the least-loaded engine -> the reward pool
scores every attempt -> the whole group is appended to the samples stream (or, with dynamic sampling, dropped and
counted when its attempts are all right or all wrong: see `dynamic_sampling_drop`). Generation never waits for
training, except where `max_lag`
says a new group would reach the trainer too stale: a group started now waits behind the samples streamed or in
flight that the trainer has not taken yet (its control messages say how many it took), so it is trained on
floor(queued / samples_per_step) versions after the weights the engines hold now; it may start only if that is
at most `max_lag`. With `max_lag: 0` this is synchronous RL: one batch per version, generated, trained on,
then the next.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from pipelinerl.config import RunConfig, load_config
from pipelinerl.contracts.inference import GenerateRequest, GenerateResponse, SamplingParams
from pipelinerl.engines.client import AsyncEngineClient
from pipelinerl.procs import POOL_SOLVED_EXIT, engine_urls, role_arguments
from pipelinerl.rewards import RewardPool, RewardResult
from pipelinerl.rewards.pool import resolve
from pipelinerl.rewards.shaping import shape_reward
from pipelinerl.samples import Sample, domain_key
from pipelinerl.streams import SLOW_POLL_S, PollWait, open_reader, open_writer
from pipelinerl.streams import streams_dir as streams_dir  # re-exported: it used to live here
from pipelinerl.tasks import is_multi_turn, reward_item, task_from_config
from pipelinerl.tasks.base import problem_sampling, prompt_token_ids, reward_preload
from pipelinerl.tasks.curriculum import DomainCurriculum, curriculum_for
from pipelinerl.tasks.workflow import RolloutEngine, run_episodes

ENGINE_RETRY_S = 2.0  # how long an engine that could not be reached gets no requests before it is tried again
log = logging.getLogger("pipelinerl.actor")


def dynamic_sampling_drop(samples: Sequence[Sample]) -> str | None:
    """Why dynamic sampling drops this group, "all_correct" or "all_wrong", or None to keep it.

    The test is correctness (`reward_parts["correct"]`), not the shaped reward, as DAPO filters on accuracy (verl's
    `algorithm.filter_groups.metric: acc` in its DAPO recipe keeps a group when the metric's std is > 0): a group
    that is all wrong but whose rewards differ by a length penalty or the cosine length reward would teach only
    "be shorter" or "be longer", with no signal about being right. A group of one is kept, as verl keeps it: there
    is no group to compare within, and dropping every such group would starve a `group_size: 1` run.
    """
    if len(samples) < 2:
        return None
    correct = {s.correct for s in samples}
    if len(correct) > 1:
        return None
    return "all_correct" if correct.pop() else "all_wrong"


class InPlaceFile:
    """A small text file rewritten in place after every streamed group (the actor's resume state): one `pwrite`
    on a descriptor kept open, instead of an open, truncate, write and close each time (8% of the actor's CPU on
    the tiny recipe). The text is padded with spaces to at least its previous length, so a shorter text leaves no
    tail of the longer one and the file is never empty or cut short between two writes (JSON readers skip the
    spaces)."""

    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = None  # opened by the first write: until then an earlier run's file stays as it was
        self.length = 0

    def write(self, text: str) -> None:
        if self.fd is None:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            self.length = os.fstat(self.fd).st_size
        data = text.encode().ljust(self.length)
        os.pwrite(self.fd, data, 0)
        self.length = len(data)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class RunStalled(RuntimeError):
    """The run cannot make progress (dynamic sampling drops every group); the actor exits with an error."""


class PoolSolved(Exception):
    """Every training problem was retired as solved (actor.retire_solved), or what is left keeps coming back all
    wrong on problems this policy has (nearly) never answered right: the actor exits with POOL_SOLVED_EXIT and the
    launcher ends the run as a success."""


# A run of all-wrong groups is a collapse when the policy, as good as it was lately on those same problems, would
# have answered at least this many of their answers right (each problem's recent pass rate; a problem not seen
# before at the policy's pass rate so far): the chance of none right is then below e^-3, about 5%. Fewer expected:
# the run is of problems out of the policy's reach, not a policy that lost what it knew.
COLLAPSE_EXPECTED_RIGHT = 3.0
# a problem's recent pass rate: each group's share of right answers weighs this much against the rate before it, so
# a lucky answer long ago fades in a few visits (one right of 8, then three groups all wrong: 0.008) while a problem
# answered half right last time counts 0.5
RECENT_WEIGHT = 0.5
HISTORY_SAVE_EVERY = 64  # groups between saves of actor_history.json (a restart loses at most these)


class Actor:
    def __init__(self, cfg: RunConfig, engine_urls: list[str]):
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.task = task_from_config(cfg.task)
        self.reward_fn = resolve(cfg.task.reward_fn) if cfg.task.reward_fn else self.task.reward_fn
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.engines = [AsyncEngineClient(u) for u in engine_urls]
        self.samples = open_writer(cfg.streams, self.run_dir, "samples", "actor")
        self.control = open_reader(cfg.streams, self.run_dir, "control")
        self.state_path = self.run_dir / "actor_state.json"
        text = self.state_path.read_text() if self.state_path.exists() else ""
        state = json.loads(text) if text.strip() else {}  # empty: the actor stopped before its first group
        self.state_file = InPlaceFile(self.state_path)
        self.problems = self.task.train_problems()
        self.order = list(range(len(self.problems)))
        random.Random(cfg.seed).shuffle(self.order)
        self.next_problem = state.get("next_problem", 0)
        # under dynamic sampling with actor.retire_solved: problems whose group came back all right, not sampled
        # again (ProRL's and DAPO's pruning of solved prompts), kept across restarts
        self.retired: set[int] = set(state.get("retired", []))
        # actor.curriculum: each group's domain drawn by its pass rate (None: the seeded order above)
        self.curriculum: DomainCurriculum | None = curriculum_for(self.task, self.problems, cfg.actor, cfg.seed,
                                                                  state.get("curriculum"))
        self.streamed = state.get("streamed_samples", 0)  # samples the trainer will read, in order
        self.in_flight = 0  # samples being generated or scored
        self.trainer_version = 0
        self.trainer_consumed = 0  # samples the trainer has taken from the stream (its control messages say)
        # of those, the fresh ones already in the batch of its current version (it says, when it asks for more)
        self.trainer_taking = 0
        self.done = False
        # groups_dropped_*: dropped by dynamic sampling (`dynamic_sampling_drop`). samples_generated(_correct):
        # every answer of every scored group, kept or dropped. Their accuracy is the policy's own; under dynamic
        # sampling the trainer's reward_mean is that of the kept groups, which have a right and a wrong answer,
        # so it can rise while the policy gets no better (plot.generated_accuracy turns these into a curve)
        self.counts = {"groups_started": 0, "groups_streamed": 0, "groups_dropped_all_correct": 0,
                       "groups_dropped_all_wrong": 0, "groups_failed": 0, "samples_streamed": self.streamed,
                       "samples_generated": 0, "samples_generated_correct": 0, "requests_resent": 0}
        self.started = time.monotonic()
        self.launch_id = uuid.uuid4().hex[:8]
        self.dropped_in_a_row = 0
        # each training problem's recent pass rate and groups seen, over the whole run (kept across restarts in
        # actor_history.json): what tells a policy that lost what it knew from problems it never could answer
        self.history_path = self.run_dir / "actor_history.json"
        text = self.history_path.read_text() if self.history_path.exists() else ""
        self.history: dict[int, list[float]] = {int(k): v for k, v in
                                                (json.loads(text) if text.strip() else {}).items()}
        self.history_unsaved = 0
        # in the current run of all-wrong drops: the right answers the policy would have given at its past pass rates
        self.expected_right_in_a_row = 0.0
        self.stalled: str | None = None  # why the run cannot go on (dynamic sampling keeps dropping every group)
        # every training problem retired as solved, or all but a few that keep coming back all wrong: the run is
        # over, and it succeeded
        self.pool_solved = False
        self.down_until: dict[str, float] = {}  # engine URL -> until when it is not sent requests

    # --- the loop --------------------------------------------------------------------------------------------

    async def run(self) -> None:
        cfg = self.cfg
        per_engine_groups = max(1, cfg.actor.concurrency // cfg.sampling.group_size)
        tasks: set[asyncio.Task] = set()
        with RewardPool(cfg.reward.workers, cfg.reward.timeout_s, memory_limit_mb=cfg.reward.memory_limit_mb,
                        preload=reward_preload(self.task)) as pool:
            self.pool = pool
            last_report = 0.0
            held = PollWait()  # a free place waiting for the trainer's next version (max_lag)
            left_free = 0  # places free at the end of the last turn
            while not self.done:
                self._read_control()
                capacity = per_engine_groups * len(self.engines) - len(tasks)
                free = capacity
                while capacity > 0 and not self.done and self._may_start_group():
                    index = self._take_problem()
                    if index is None:  # every problem is solved
                        break
                    task = asyncio.create_task(self._group(self.problems[index], index))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    capacity -= 1
                if time.monotonic() - last_report > 5:
                    self._report()
                    last_report = time.monotonic()
                # wake as soon as a group finishes (its place goes to the next group at once: on a small model a
                # group takes tens of ms, and a fixed sleep left the engine short of work), or to read the trainer's
                # control messages, which lift the max_lag bound: soon after a place is held back by it (the
                # stream's fast polling), since then the engine may be idle until the next version is read
                if capacity > 0 and not self.done:
                    # the wait starts again with each group started or finished (a turn after none was free
                    # included): from there the next version may be what the actor waits for
                    if capacity < free or free > left_free:
                        held.restart()
                    timeout = held.interval()
                else:
                    timeout = SLOW_POLL_S
                left_free = capacity
                if tasks:
                    await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                else:
                    await asyncio.sleep(timeout)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        self._report()
        for e in self.engines:
            await e.aclose()
        self.samples.close()
        self.state_file.close()
        self._save_history(force=True)
        if self.stalled:
            raise RunStalled(self.stalled)
        if self.pool_solved:
            raise PoolSolved()

    def _may_start_group(self) -> bool:
        # The samples streamed or in flight that the trainer has not taken yet go before a group started now:
        # it is consumed that many full steps after the trainer's current version. Counting from what the
        # trainer says it consumed (not from the step number) keeps this right when it drops stale samples.
        # A trainer that dropped stale samples and asks for more mid-batch has already taken `trainer_taking` of its
        # current version's batch: the queue fills the rest of that batch first, so it counts them too (without,
        # groups started then land a version later than planned, and under dynamic sampling, whose dropped groups
        # make the trainer ask often, a fifth of the samples went stale).
        queued = self.streamed + self.in_flight - self.trainer_consumed + self.trainer_taking
        steps_ahead = max(0, queued) // self.cfg.trainer.samples_per_step
        if self.trainer_version + steps_ahead >= self.cfg.trainer.max_steps:
            return False  # enough samples for the rest of the run are streamed or on their way
        if self.cfg.actor.one_step_off_policy and queued % self.cfg.trainer.samples_per_step == 0 and self.in_flight:
            # one-step off-policy: whole batches, each by one version. The max_lag 1 bound below lets batch k + 1
            # start once the trainer announced version k, which it does only once batch k is streamed whole (it
            # waits for it before sending the weights); here a batch also waits for the groups of the one before
            # it still in flight. Counted from what the trainer took, as the bound is, so samples it dropped (stale
            # ones from a restarted engine) are made up within the batch instead of shifting every later one.
            return False
        return steps_ahead <= self.cfg.actor.max_lag

    def _take_problem(self) -> int | None:
        """The index of the next training problem, in a seeded order reshuffled every epoch, skipping retired
        (solved) ones; None once every problem is retired, which ends the run as a success."""
        if len(self.retired) >= len(self.problems):
            self._finish_solved()
            return None
        if self.curriculum is not None:
            return self.curriculum.take(self.retired)
        while True:
            index = self.order[self.next_problem % len(self.order)]
            self.next_problem += 1
            if self.next_problem % len(self.order) == 0:  # a new epoch, a new order
                random.Random(self.cfg.seed + self.next_problem).shuffle(self.order)
            if index not in self.retired:
                return index

    def _finish_solved(self) -> None:
        if not self.pool_solved:
            log.info("every one of the %d training problems came back with all %d answers right and is retired "
                     "(actor.retire_solved): nothing is left to learn from; the run ends here", len(self.problems),
                     self.cfg.sampling.group_size)
        self.pool_solved = self.done = True

    def _read_control(self) -> None:
        for msg in self.control.read():
            if msg.get("kind") == "version":
                version = int(msg["version"])
                if version > self.trainer_version:
                    self.trainer_version, self.trainer_taking = version, 0
                if version == self.trainer_version:
                    self.trainer_taking = max(self.trainer_taking, int(msg.get("taking", 0)))
                self.trainer_consumed = max(self.trainer_consumed, int(msg.get("consumed", 0)))
            elif msg.get("kind") == "done":
                self.done = True

    # --- one group ---------------------------------------------------------------------------------------------

    async def _group(self, problem: dict, index: int | None = None) -> None:
        cfg = self.cfg
        g = cfg.sampling.group_size
        self.in_flight += g
        self.counts["groups_started"] += 1
        try:
            samples = await self._generate_and_score(problem)
        except asyncio.CancelledError:
            self.in_flight -= g
            raise
        except Exception as e:  # an engine error loses this group only; the run goes on
            log.warning("group for problem %s failed: %s", problem.get("id"), e)
            self.counts["groups_failed"] += 1
            self.in_flight -= g
            return
        self.in_flight -= g
        self._stream_group(samples, index)

    def _stream_group(self, samples: list[Sample], index: int | None = None) -> None:
        """Append a scored group to the samples stream in one write (the trainer takes groups whole), or drop it
        under dynamic sampling and count why: a solved problem (all right) is retired from the pool
        (`actor.retire_solved`), and only hopeless groups (all wrong) in a row stop the run, a policy that gets
        nothing right any more; a policy that solves its problems has not collapsed."""
        right = sum(s.correct for s in samples)
        past_rate = self._past_pass_rate(index)
        if index is not None and samples:
            rate, groups = self.history.get(index, (0.0, 0))
            share = right / len(samples)
            rate = share if not groups else (1 - RECENT_WEIGHT) * rate + RECENT_WEIGHT * share
            self.history[index] = [round(rate, 6), groups + 1]
            self._save_history()
        self.counts["samples_generated"] += len(samples)
        self.counts["samples_generated_correct"] += right
        domain = samples[0].domain if samples else ""
        if self.curriculum is not None:
            self.curriculum.observe(domain, right, len(samples))
        if domain:  # a mix's (or Reasoning Gym's) domains counted apart: their accuracy and drops never blended
            key = domain_key(domain)
            for name, value in (("samples_generated", len(samples)), ("samples_generated_correct", right)):
                self.counts[f"domain_{key}_{name}"] = self.counts.get(f"domain_{key}_{name}", 0) + value
        if self.cfg.actor.dynamic_sampling and (why := dynamic_sampling_drop(samples)) is not None:
            self.counts[f"groups_dropped_{why}"] += 1
            if domain:
                self.counts[f"domain_{key}_groups_dropped_{why}"] = self.counts.get(
                    f"domain_{key}_groups_dropped_{why}", 0) + 1
            if why == "all_correct":
                if self.cfg.actor.retire_solved and index is not None:
                    self.retired.add(index)
                    self.counts["problems_retired"] = len(self.retired)
                    self._save_state()
                return
            self.dropped_in_a_row += 1
            self.expected_right_in_a_row += past_rate * len(samples)
            if self.dropped_in_a_row >= self.max_dropped_in_a_row > 0 and not self.done:
                self._dropped_too_many()
            return
        self.dropped_in_a_row, self.expected_right_in_a_row = 0, 0.0
        self.samples.write_many([s.model_dump() for s in samples])
        self.streamed += len(samples)
        self.counts["groups_streamed"] += 1
        self.counts["samples_streamed"] = self.streamed
        self._save_state()

    def _past_pass_rate(self, index: int | None) -> float:
        """This policy's recent pass rate on problem `index` (RECENT_WEIGHT), or its share of right answers over
        every problem so far where it has not seen this one (0 before any answer)."""
        rate, groups = self.history.get(index, (0.0, 0)) if index is not None else (0.0, 0)
        if groups:
            return rate
        generated = self.counts["samples_generated"]
        return self.counts["samples_generated_correct"] / generated if generated else 0.0

    def _dropped_too_many(self) -> None:
        """`actor.max_dropped_in_a_row` all-wrong groups in a row: end the run. A success where the policy solved its
        pool but for problems out of its reach (it never, or hardly ever, answered them right); a stall where it
        got problems wrong that it used to answer right, or never answered anything right."""
        left = len(self.problems) - len(self.retired)
        learnt = (bool(self.retired) or self.counts["samples_generated_correct"] > 0
                  or any(rate > 0 for rate, _ in self.history.values()))
        if self.retired and 2 * left <= self.dropped_in_a_row:
            # all but a few problems are solved and retired, and each of those few came back all wrong at least twice
            # (on average) in this run of drops
            log.info("dynamic sampling dropped %d groups in a row whose answers were all wrong, all of them on the %d "
                     "training problems not yet solved (%d of %d are retired as solved, actor.retire_solved): they "
                     "are out of this policy's reach, and nothing else is left to learn from; the run ends here",
                     self.dropped_in_a_row, left, len(self.retired), len(self.problems))
            self.pool_solved = self.done = True
        elif learnt and self.expected_right_in_a_row < COLLAPSE_EXPECTED_RIGHT:
            log.info("dynamic sampling dropped %d groups in a row whose answers were all wrong, on problems this "
                     "policy has hardly ever answered right (at their past pass rates %.1f right answers were to be "
                     "expected in those groups, against %.0f for a collapse; %d of %d problems are retired as "
                     "solved): what is left of the pool is out of its reach, not forgotten, and gives nothing to "
                     "learn from; the run ends here (actor.max_dropped_in_a_row 0 goes on sampling)",
                     self.dropped_in_a_row, self.expected_right_in_a_row, COLLAPSE_EXPECTED_RIGHT,
                     len(self.retired), len(self.problems))
            self.pool_solved = self.done = True
        else:
            was = (f"; at their past pass rates {self.expected_right_in_a_row:.0f} of those answers would have been "
                   "right" if learnt else "")
            self.stalled = (
                f"dynamic sampling dropped {self.dropped_in_a_row} groups in a row whose answers were all wrong "
                f"(since this actor started: {self.counts['groups_dropped_all_wrong']} all wrong, "
                f"{self.counts['groups_dropped_all_correct']} all right, {self.counts['groups_streamed']} kept{was}), "
                "so the trainer gets no samples: the policy gets nothing right on these problems any more. "
                "Restart from a checkpoint before the collapse with a lower trainer.lr (a run resumes from the "
                "newest of RUN_DIR/checkpoints/step_*: move the later ones aside), use easier problems, or raise "
                "actor.max_dropped_in_a_row (0: no limit)")
            self.done = True
        self._save_history(force=True)

    def _save_history(self, force: bool = False) -> None:
        self.history_unsaved += 1
        if force or self.history_unsaved >= HISTORY_SAVE_EVERY:
            tmp = self.history_path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self.history, separators=(",", ":")))
            tmp.replace(self.history_path)
            self.history_unsaved = 0

    def _save_state(self) -> None:
        state = {"next_problem": self.next_problem, "streamed_samples": self.streamed, "retired": sorted(self.retired)}
        if self.curriculum is not None:
            state["curriculum"] = self.curriculum.state()
        self.state_file.write(json.dumps(state))

    @property
    def max_dropped_in_a_row(self) -> int:
        limit = self.cfg.actor.max_dropped_in_a_row
        if limit is None:  # ten steps' worth of groups
            return 10 * max(1, self.cfg.trainer.samples_per_step // self.cfg.sampling.group_size)
        return limit

    async def _generate_and_score(self, problem: dict) -> list[Sample]:
        if is_multi_turn(self.task):
            return await self._episodes_and_score(problem)
        cfg = self.cfg
        prompt_ids = prompt_token_ids(self.tokenizer, self.task.prompt(problem), cfg.model.chat_template)
        max_new_tokens, stop = problem_sampling(problem, cfg.sampling.max_new_tokens, list(cfg.sampling.stop))
        t0 = time.monotonic()
        req = GenerateRequest(prompt_token_ids=prompt_ids, sampling=SamplingParams(
            temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p, top_k=cfg.sampling.top_k,
            max_new_tokens=max_new_tokens, n=cfg.sampling.group_size, stop=stop))
        resp = await self._generate_on_a_live_engine(req)
        t_gen = time.monotonic() - t0
        texts = [self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in resp.completions]
        items = [reward_item(problem, text, c.finish_reason) for text, c in zip(texts, resp.completions)]
        results = await self.pool.score_async(self.reward_fn, items)
        t_reward = time.monotonic() - t0 - t_gen
        # unique across the run: a restarted actor counts from 0 again, under a new launch id
        group_id = f"{problem.get('id', 'p')}-{self.launch_id}-{self.counts['groups_started']}"
        return [self._sample(group_id, prompt_ids, c.token_ids, c.logprobs, c.versions, c.finish_reason, r,
                             {"generate_s": t_gen, "reward_s": t_reward}, max_len=max_new_tokens,
                             domain=problem.get("domain", ""))
                for c, r in zip(resp.completions, results)]

    async def _episodes_and_score(self, problem: dict) -> list[Sample]:
        """A multi-turn task's group: `group_size` episodes of its `rollout` (pipelinerl.tasks.workflow), each turn sent
        to a live engine, then scored like any group."""
        cfg = self.cfg
        t0 = time.monotonic()
        engine = RolloutEngine(self._generate_on_a_live_engine, self.tokenizer, SamplingParams(
            temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p, top_k=cfg.sampling.top_k,
            max_new_tokens=cfg.sampling.max_new_tokens, stop=list(cfg.sampling.stop)), cfg.engine.max_model_len)
        episodes = await run_episodes(self.task, problem, engine, cfg.sampling.group_size)
        t_gen = time.monotonic() - t0
        items = [reward_item(problem, engine.decode(e.output_token_ids), e.finish_reason, turns=e.turns,
                             tool_calls=e.tool_calls, **e.info) for e in episodes]
        results = await self.pool.score_async(self.reward_fn, items)
        t_reward = time.monotonic() - t0 - t_gen
        group_id = f"{problem.get('id', 'p')}-{self.launch_id}-{self.counts['groups_started']}"
        return [self._sample(group_id, e.prompt_token_ids, e.output_token_ids, e.logprobs, e.versions,
                             e.finish_reason, r, {"generate_s": t_gen, "reward_s": t_reward, "turns": e.turns,
                                                  "tool_calls": e.tool_calls}, e.output_mask,
                             max_len=cfg.engine.max_model_len - len(e.prompt_token_ids),
                             domain=problem.get("domain", ""))
                for e, r in zip(episodes, results)]

    async def _generate_on_a_live_engine(self, req: GenerateRequest) -> GenerateResponse:
        """The request on the least busy engine that is up. An engine that cannot be reached (it died; its
        launcher restarts it) is left alone for ENGINE_RETRY_S and the request goes to another one, from the
        start: a group is generated whole by one engine. Waits while every engine is down, up to
        `engine.restart_wait_s`."""
        deadline = time.monotonic() + self.cfg.engine.restart_wait_s
        while True:
            now = time.monotonic()
            live = [e for e in self.engines if self.down_until.get(e.url, 0.0) <= now]
            if not live:
                if now > deadline:
                    raise ConnectionError(f"no engine reachable for {self.cfg.engine.restart_wait_s:g} s "
                                          "(engine.restart_wait_s)")
                await asyncio.sleep(0.5)
                continue
            engine = min(live, key=lambda e: e.in_flight)
            try:
                return await engine.generate(req)
            except ConnectionError as e:
                self.down_until[engine.url] = time.monotonic() + ENGINE_RETRY_S
                self.counts["requests_resent"] += 1
                log.warning("%s; sending the request to another engine", e)

    def _sample(self, group_id: str, prompt_ids: list[int], token_ids: list[int], logprobs: list[float],
                versions: list[int], finish_reason: str, result: RewardResult, timings: dict[str, float],
                output_mask: list[int] | None = None, max_len: int | None = None, domain: str = "") -> Sample:
        correct = bool(result.parts.get("correct", result.reward > 0))
        # length shaping counts the model's tokens, against what it may write: one completion's max_new_tokens,
        # or, for a multi-turn episode (`max_len`), the context left after the prompt
        written = sum(output_mask) if output_mask else len(token_ids)
        reward, shaping = shape_reward(result.reward, correct, written, finish_reason,
                                       max_len or self.cfg.sampling.max_new_tokens, self.trainer_version,
                                       self.cfg.reward)
        return Sample(group_id=group_id, prompt_token_ids=prompt_ids, output_token_ids=token_ids,
                      behav_logprobs=logprobs, versions=versions, output_mask=output_mask or [],
                      finish_reason=finish_reason, reward=reward,
                      reward_parts={**result.parts, **shaping, "correct": float(correct)},
                      reward_info=result.info, task=self.task.name, domain=str(domain), timings=timings)

    def _report(self) -> None:
        row = {"time": time.monotonic() - self.started, "trainer_version": self.trainer_version,
               "in_flight": self.in_flight, **self.counts,
               **{f"reward_{k}": v for k, v in self.pool.stats().items()}}
        if self.curriculum is not None:  # each domain's share of the next draws and the pass rate behind it
            shares = self.curriculum.weights(self.retired)
            for domain, share in shares.items():
                row[f"domain_{domain_key(domain)}_curriculum_share"] = share
                row[f"domain_{domain_key(domain)}_curriculum_pass_rate"] = self.curriculum.pass_rate[domain]
        with open(self.run_dir / "actor_metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = role_arguments("actor", __doc__.splitlines()[0], argv)
    actor = Actor(load_config(args.config), engine_urls(args.engines))
    signal.signal(signal.SIGTERM, lambda *_: setattr(actor, "done", True))
    try:
        asyncio.run(actor.run())
    except RunStalled as e:
        log.error("%s", e)  # the launcher shows the end of this log and stops the run (the trainer checkpoints)
        return 1
    except PoolSolved:
        return POOL_SOLVED_EXIT  # the launcher stops the trainer (it checkpoints) and the run ends with 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
