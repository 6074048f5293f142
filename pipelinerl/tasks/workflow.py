"""Multi-turn rollouts: a task that drives the engine itself, for tools and environments.

A single-turn task gives a prompt; the actor asks an engine for `group_size` completions and scores them. A task
may instead define

    async def rollout(self, engine: RolloutEngine, problem: dict) -> Episode

(the shape of AReaL's `RolloutWorkflow.arun_episode`): it calls `engine.generate` as often as it likes, putting what
the environment says between the model's turns with `Episode.add_observation`. The actor runs `group_size`
episodes of a problem at once, scores each with the task's `reward_fn` (the item's "completion" is the episode's
whole text, observations included; its "turns" and "tool_calls" are there too), and streams them like any group.

What the trainer gets: one sample per episode, its output being every token after the prompt, the model's and the
environment's, in order. The environment's tokens carry `output_mask` 0: they are context for the tokens after
them and never trained on (their gradient is exactly zero, tests/test_multiturn.py); their log-prob is 0 and
their version -1, since no policy produced them. The model's tokens keep the engine's log-probs and versions.

`python_tool_rollout` below is the built-in code-interpreter loop (the model writes a fenced python block, the
block runs in the sandbox, its output comes back as an observation); pipelinerl/tasks/interpreter.py uses it and
is the example to copy for an environment of your own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pipelinerl.contracts.inference import MAX_SEED, Completion, GenerateRequest, GenerateResponse, SamplingParams

Generate = Callable[[GenerateRequest], Awaitable[GenerateResponse]]


@dataclass
class Episode:
    """One multi-turn episode as it is built: the prompt, then model turns and observations in order."""

    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    output_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    turns: int = 0  # model turns
    tool_calls: int = 0
    info: dict[str, Any] = field(default_factory=dict)  # anything the task wants the reward function to see

    @property
    def context(self) -> list[int]:
        """The tokens the next model turn continues from."""
        return self.prompt_token_ids + self.output_token_ids

    def add_model_turn(self, completion: Completion) -> None:
        self.output_token_ids += completion.token_ids
        self.output_mask += [1] * len(completion.token_ids)
        self.logprobs += completion.logprobs
        self.versions += completion.versions
        self.finish_reason = completion.finish_reason
        self.turns += 1

    def add_observation(self, token_ids: list[int]) -> None:
        """Tokens the environment puts in the context: seen by later turns, never trained on."""
        self.output_token_ids += token_ids
        self.output_mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.versions += [-1] * len(token_ids)


class RolloutEngine:
    """What a task's `rollout` sees: the tokenizer, the context budget and one call, `generate`, which samples one
    continuation with the run's sampling settings (temperature, top-p/k) on whichever engine the actor picks."""

    def __init__(self, generate: Generate, tokenizer: Any, sampling: SamplingParams, max_model_len: int,
                 episode: int = 0) -> None:
        self._generate = generate
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.max_model_len = max_model_len
        self.episode = episode  # which episode of the group: seeded requests must differ between episodes

    def for_episode(self, episode: int) -> RolloutEngine:
        return RolloutEngine(self._generate, self.tokenizer, self.sampling, self.max_model_len, episode)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    async def generate(self, context: list[int], max_new_tokens: int | None = None,
                       stop: list[str] | None = None) -> Completion:
        """One completion of `context`, at most `max_new_tokens` (the run's `sampling.max_new_tokens` by default)
        and never past `max_model_len`; stops at any of `stop` (added to the run's stop strings)."""
        room = self.max_model_len - len(context)
        if room < 1:
            return Completion(token_ids=[], logprobs=[], versions=[], finish_reason="length")
        # a seeded evaluation draws each episode, and each turn of it, with a seed of its own
        seed = None if self.sampling.seed is None else \
            (self.sampling.seed + 1_000_003 * self.episode + len(context)) % MAX_SEED
        params = self.sampling.model_copy(update={
            "n": 1, "max_new_tokens": min(room, max_new_tokens or self.sampling.max_new_tokens),
            "stop": list(dict.fromkeys([*self.sampling.stop, *(stop or [])])), "seed": seed})
        resp = await self._generate(GenerateRequest(prompt_token_ids=context, sampling=params))
        return resp.completions[0]


async def run_episodes(task: Any, problem: dict, engine: RolloutEngine, n: int) -> list[Episode]:
    """`n` episodes of one problem, run concurrently. If one fails, the others are cancelled (the group is lost
    as a whole: it is scored and trained on only as a group), and so is an episode in which the model wrote
    nothing (a prompt that fills the context): the error says why."""
    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(task.rollout(engine.for_episode(i), problem)) for i in range(n)]
    episodes = [t.result() for t in tasks]
    for e in episodes:
        if not any(e.output_mask):
            raise ValueError(f"an episode of problem {problem.get('id')!r} has no token of the model's: its prompt "
                             f"({len(e.prompt_token_ids)} tokens) leaves no room in max_model_len "
                             f"{engine.max_model_len}")
    return episodes


# --- the built-in code interpreter ---------------------------------------------------------------------------


@dataclass(frozen=True)
class InterpreterSyntax:
    """How a tool call and its answer look in the text. The model opens a call with `call_start` and closes it
    with `call_end` (a stop string: generation pauses there); the output comes back as `observation`.
    The defaults are the fenced blocks most code-reasoning models already write."""

    call_start: str = "```python\n"
    call_end: str = "```\n"
    observation: str = "```output\n{output}```\n"
    max_output_chars: int = 512


def tool_call(text: str, syntax: InterpreterSyntax) -> str | None:
    """The code of the call that ends this turn's text, or None when the turn did not end in one: the text after
    the last `call_start`, up to the `call_end` that stopped generation."""
    end = text.rfind(syntax.call_end)
    if end < 0:
        return None
    start = text.rfind(syntax.call_start, 0, end)
    if start < 0:
        return None
    return text[start + len(syntax.call_start):end]


async def run_tool_code(code: str, limits: Any = None) -> str:
    """Run `code` in the sandbox (a worker thread keeps the event loop free) and return what a model should see:
    its stdout, or the last line of the error."""
    from pipelinerl.sandbox import SandboxLimits, run_python

    result = await asyncio.to_thread(run_python, code, "", limits or SandboxLimits(wall_s=5.0))
    if result.status == "ok":
        return result.stdout
    last = (result.stderr.strip().splitlines() or [result.status])[-1]
    return f"{result.stdout}{last}\n"


async def python_tool_rollout(engine: RolloutEngine, prompt: str, max_turns: int = 3,
                              syntax: InterpreterSyntax = InterpreterSyntax(), limits: Any = None) -> Episode:
    """The code-interpreter loop: generate until the model closes a tool call, run the call, append its output,
    go on; up to `max_turns` model turns and `engine.max_model_len` tokens in all. An episode whose last turn still
    asked for a tool ends with finish reason "length" (out of turns), as a truncated answer does."""
    episode = Episode(prompt_token_ids=engine.encode(prompt))
    while True:
        completion = await engine.generate(episode.context, stop=[syntax.call_end])
        episode.add_model_turn(completion)
        # what the model wrote last, for a reward that reads its answer there (the tool's output is not its own)
        episode.info["final_turn"] = engine.decode(completion.token_ids)
        # a turn that ended on the model's end-of-sequence token is its final answer, whatever its text holds
        asked = completion.finish_reason == "stop" and completion.token_ids[-1:] != [engine.tokenizer.eos_token_id]
        code = tool_call(engine.decode(completion.token_ids), syntax) if asked else None
        if code is None:
            return episode
        if episode.turns >= max_turns or len(episode.context) >= engine.max_model_len:
            break  # no room for an answer after the call
        episode.tool_calls += 1
        output = await run_tool_code(code, limits)
        if len(output) > syntax.max_output_chars:
            output = output[:syntax.max_output_chars] + "...\n"
        observation = engine.encode(syntax.observation.format(output=output))
        room = engine.max_model_len - len(episode.context) - 1  # at least one token left for the model
        if room < len(observation):
            break  # the output does not fit: the episode ends out of room, as a truncated answer does
        episode.add_observation(observation)
    episode.finish_reason = "length"
    return episode
