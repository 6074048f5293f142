"""The embedded engine's scheduler: the request queue, the running batch in the runner's slots, and the steps that
admit, decode and answer them.

The server's event loop submits requests (`submit`, then `wake`); everything else runs on the engine thread, one
`step` per step boundary: aborts are answered, the queued requests that fit `max_running_seqs` and
`max_batch_tokens` are admitted (their prompts prefilled together, once per prompt, the KV cache copied to the n
samples), and every running sequence decodes one token. Running sequences occupy slots 0..B-1 (a finished one's
slot is refilled by moving the last); a request's future is resolved when its last sample ends. One request's
parameters never fail another's: an admission that fails is retried one request at a time (`isolate`), a decode
step whose batched sampling fails is sampled row by row.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from pipelinerl.contracts.inference import Completion, GenerateResponse, SamplingParams
from pipelinerl.contracts.routes import ContractError
from pipelinerl.engines.embedded.metrics import Metrics
from pipelinerl.engines.embedded.model_runner import HFRunner, copy_slot
from pipelinerl.engines.embedded.sampling import SamplingBatch, sample_batch
from pipelinerl.engines.embedded.slot_runner import SlotRunner
from pipelinerl.engines.stops import StopStrings, StopWatch

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    max_new: int
    stop: frozenset[int]
    stop_strings: StopStrings | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    seqs: list[_Seq] = field(default_factory=list)
    aborted: bool = False
    done_count: int = 0
    # admitted alone: its admission with others failed, so it is tried by itself (see `Scheduler.isolate`)
    alone: bool = False
    error: ContractError | None = None  # set when this request alone broke a step: answered with it


@dataclass(eq=False)
class _Seq:
    req: Request
    slot: int
    last_token: int
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None
    watch: StopWatch | None = None  # only for a request with stop strings

    @property
    def length(self) -> int:
        """Tokens in the KV cache, where the next one is written: the prompt and every generated token but
        the last (the next step's input)."""
        return len(self.req.prompt) + len(self.tokens) - 1


@dataclass
class _DecodeBatch:
    """The running batch's step inputs, carried from one step to the next while no sequence joins or leaves
    (instead of rebuilt from every sequence on every step)."""

    tokens: torch.Tensor  # each sequence's next input token
    positions: torch.Tensor  # where that token goes in its KV cache
    span: tuple[int, int]  # min and max of positions
    sampling: SamplingBatch

    def advance(self, tokens: torch.Tensor) -> None:
        """After a step: the sampled tokens are the next inputs, one position further on."""
        self.tokens = tokens
        self.positions += 1
        self.span = (self.span[0] + 1, self.span[1] + 1)


class AdmissionFailed(Exception):
    """Admitting `batch` together failed (the cause is chained); nothing of it is running."""

    def __init__(self, batch: list[Request]):
        super().__init__(f"admitting {len(batch)} request(s) failed")
        self.batch = batch


class Scheduler:
    """Queues, admits, decodes and answers requests. `cv` is the engine's condition: it guards the queue (shared
    with the event loop) and is notified when there is work for the engine thread."""

    def __init__(self, runner: SlotRunner | HFRunner, max_running_seqs: int, max_batch_tokens: int,
                 metrics: Metrics, cv: threading.Condition):
        self.runner = runner
        self.max_running_seqs, self.max_batch_tokens = max_running_seqs, max_batch_tokens
        self.metrics = metrics
        self._cv = cv
        self._waiting: deque[Request] = deque()
        self._incoming: list[Request] = []  # submitted, handed to the engine thread by `wake`
        self._requests: dict[str, Request] = {}
        self._running: list[_Seq] = []
        self._reserved_tokens = 0
        self._abort_flag = False
        self._batch: _DecodeBatch | None = None

    # --- the event loop's side -----------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Register a request; the engine thread sees it at the next `wake`."""
        with self._cv:
            if request.id in self._requests:
                raise ContractError(409, f"request_id {request.id!r} is already running", "request_id")
            self._requests[request.id] = request
            self._incoming.append(request)

    def wake(self) -> None:
        """Hand every request submitted since the last call to the engine thread."""
        with self._cv:
            if not self._incoming:
                return
            self._waiting.extend(self._incoming)
            self._abort_flag |= any(r.aborted for r in self._incoming)  # aborted before the engine saw them
            self._incoming.clear()
            self._cv.notify()

    def abort(self, request_id: str | None) -> list[str]:
        """Mark the request (every request, for None) aborted; the engine thread answers it. Returns the ids."""
        with self._cv:
            targets = list(self._requests.values()) if request_id is None else (
                [self._requests[request_id]] if request_id in self._requests else [])
            for r in targets:
                r.aborted = True
            self._abort_flag = bool(targets) or self._abort_flag
            self._cv.notify()
        return [r.id for r in targets]

    def busy(self) -> bool:
        """Requests running or queued (an update's copies are then built before its switch)."""
        with self._cv:
            return bool(self._running or self._waiting or self._incoming)

    def queue_lengths(self) -> tuple[int, int]:
        """(sequences running, requests waiting for admission)."""
        with self._cv:
            return len(self._running), len(self._waiting) + len(self._incoming)

    # --- the engine thread's side --------------------------------------------------------------------------

    @property
    def decoding(self) -> bool:
        """Sequences are running."""
        return bool(self._running)

    def has_work(self) -> bool:
        """Something for `step` to do; read under `cv`."""
        return bool(self._running or self._waiting or self._abort_flag)

    def step(self, version: int) -> None:
        """One step boundary's work: answer aborts, admit what fits, decode one token of every running sequence.
        `version`: the weights' version, recorded with every token this step generates. Raises
        `AdmissionFailed` (answered by `isolate`) and anything a step broke on (answered by `fail_all`)."""
        self._handle_aborts()
        self._admit(version)
        if self._running:
            self._decode_step(version)

    def _handle_aborts(self) -> None:
        with self._cv:
            if not self._abort_flag:
                return
            self._abort_flag = False
            waiting = [r for r in self._waiting if r.aborted]
            for r in waiting:
                self._waiting.remove(r)
        for r in waiting:
            self._finish_request(r)
        finished = [s for s in self._running if s.req.aborted]
        for s in finished:
            s.finish = "abort"
        self._retire(finished)

    def _admit(self, version: int) -> None:
        """Admit the queued requests that fit, prefilling their prompts together. A failure before the new
        sequences produced their first token is raised as `AdmissionFailed`, with the running batch as it was."""
        batch = self._take_admissible()
        if not batch:
            return
        first = len(self._running)
        heads, seqs = [], []
        try:
            for req in batch:
                head = first + len(seqs)
                heads.append(head)
                req.seqs = [_Seq(req, head + i, -1, self._generator(req.params, i),
                                 watch=req.stop_strings.watch() if req.stop_strings else None)
                            for i in range(req.params.n)]
                seqs.extend(req.seqs)
            logits = self.runner.prefill_batch(heads, [req.prompt for req in batch])
            self.metrics.admissions += 1
            for req, head in zip(batch, heads):
                for i in range(1, req.params.n):
                    copy_slot(self.runner, head, head + i, len(req.prompt))
            counts = torch.tensor([req.params.n for req in batch], device=logits.device)
            tokens, logprobs = sample_batch(logits.repeat_interleave(counts, dim=0), self._sampling(seqs))
        except Exception as e:
            # nothing of these requests is running yet: the slots they prefilled are free again
            for req in batch:
                req.seqs = []
            self._reserved_tokens -= sum(r.params.n * (len(r.prompt) + r.max_new) for r in batch)
            raise AdmissionFailed(batch) from e
        self._running.extend(seqs)
        self._batch = None
        self._append(seqs, tokens.tolist(), logprobs.tolist(), version)

    def isolate(self, batch: list[Request], error: BaseException) -> None:
        """After an admission failed: a request that failed alone is answered with the error; the others go back to
        the front of the queue, each to be admitted alone, so that one request's parameters never fail another's."""
        if len(batch) == 1 and batch[0].alone:
            req = batch[0]
            req.error = ContractError(500, f"this request could not be served: {type(error).__name__}: {error}",
                                      type="engine_error")
            self._finish_request(req)
            return
        with self._cv:
            for req in reversed(batch):
                req.alone = True
                self._waiting.appendleft(req)

    def _take_admissible(self) -> list[Request]:
        """Pop the queued requests that fit the running limits, in order, and reserve their tokens."""
        batch: list[Request] = []
        running = len(self._running)
        with self._cv:
            while self._waiting:
                req = self._waiting[0]
                need = req.params.n * (len(req.prompt) + req.max_new)
                if running + req.params.n > self.max_running_seqs or (
                        running and self._reserved_tokens + need > self.max_batch_tokens):
                    break
                if batch and (req.alone or batch[0].alone):  # being isolated after a failed admission
                    break
                self._waiting.popleft()
                self._reserved_tokens += need
                running += req.params.n
                batch.append(req)
        return batch

    def _generator(self, params: SamplingParams, sample_index: int) -> torch.Generator | None:
        if params.seed is None:
            return None
        g = torch.Generator(device=self.runner.device)
        g.manual_seed(params.seed + sample_index)
        return g

    def _sampling(self, seqs: list[_Seq]) -> SamplingBatch:
        params = [s.req.params for s in seqs]
        return SamplingBatch.of([p.temperature for p in params], [p.top_k for p in params],
                                [p.top_p for p in params], [s.generator for s in seqs], self.runner.device)

    def _decode_batch(self) -> _DecodeBatch:
        if self._batch is None:
            running, device = self._running, self.runner.device
            lengths = [s.length for s in running]
            self._batch = _DecodeBatch(torch.tensor([s.last_token for s in running], device=device),
                                       torch.tensor(lengths, device=device), (min(lengths), max(lengths)),
                                       self._sampling(running))
        return self._batch

    def _decode_step(self, version: int) -> None:
        t0 = time.perf_counter()
        batch = self._decode_batch()
        logits = self.runner.decode(batch.tokens, batch.positions, batch.span)
        try:
            tokens, logprobs = sample_batch(logits, batch.sampling)
        except Exception as e:  # per-row parameters broke the batched sampling: sample row by row, fail the bad
            self._sample_each(logits, e, version)
            return
        batch.advance(tokens)
        self.metrics.decode_steps += 1  # before `_append` answers finished requests
        self._append(self._running, tokens.tolist(), logprobs.tolist(), version)  # a retirement drops the batch
        self.metrics.decode_seconds += time.perf_counter() - t0

    def _sample_each(self, logits: torch.Tensor, error: Exception, version: int) -> None:
        """A decode step whose batched sampling failed: each sequence sampled alone; one that fails alone ends its
        request with the error, the others take their tokens as the step would have given them."""
        log.warning("sampling a decode step of %d sequences failed (%s: %s); sampling them one at a time",
                    len(self._running), type(error).__name__, error)
        good, tokens, logprobs, bad = [], [], [], {}
        for i, seq in enumerate(self._running):
            try:
                t, lp = sample_batch(logits[i:i + 1], self._sampling([seq]))
            except Exception as e:
                bad.setdefault(id(seq.req), (seq.req, e))
                continue
            good.append(seq)
            tokens.append(int(t[0]))
            logprobs.append(float(lp[0]))
        self.metrics.decode_steps += 1
        self._batch = None
        failed = {id(r) for r, _ in bad.values()}
        keep = [(s, t, lp) for s, t, lp in zip(good, tokens, logprobs) if id(s.req) not in failed]
        self._append([s for s, _, _ in keep], [t for _, t, _ in keep], [lp for _, _, lp in keep], version)
        for req, e in bad.values():
            req.error = ContractError(500, f"this request could not be sampled: {type(e).__name__}: {e}",
                                      type="engine_error")
            for seq in req.seqs:
                seq.finish = seq.finish or "abort"
            self._retire([seq for seq in req.seqs if seq in self._running])

    def _append(self, seqs: list[_Seq], tokens: list[int], logprobs: list[float], version: int) -> None:
        finished = []
        for s, t, lp in zip(seqs, tokens, logprobs):
            s.tokens.append(t)
            s.logprobs.append(lp)
            s.versions.append(version)
            s.last_token = t
            if t in s.req.stop:
                s.finish = "stop"
            elif s.watch is not None and s.req.stop_strings.hit(s.tokens, s.watch):
                s.finish = "stop"  # before length: a stop string completed by the last allowed token is a stop
            elif len(s.tokens) >= s.req.max_new:
                s.finish = "length"
            if s.finish:
                finished.append(s)
        self.metrics.generated_tokens += len(seqs)
        self._retire(finished)

    def _retire(self, finished: list[_Seq]) -> None:
        """Remove finished sequences, keeping the running ones in slots 0..B-1."""
        if not finished:
            return
        for seq in sorted(finished, key=lambda s: s.slot, reverse=True):
            last = self._running.pop()
            if last is not seq:
                self.runner.move_slot(last.slot, seq.slot, last.length)
                last.slot = seq.slot
                self._running[seq.slot] = last
            req = seq.req
            req.done_count += 1
            if req.done_count == len(req.seqs):
                self._reserved_tokens -= req.params.n * (len(req.prompt) + req.max_new)
                self._finish_request(req)
        self._batch = None

    def _finish_request(self, req: Request) -> None:
        if req.error is not None:
            with self._cv:
                self._requests.pop(req.id, None)
            req.loop.call_soon_threadsafe(_reject, req.future, req.error)
            return
        # model_construct: the engine built these lists itself, validating them again is engine-thread time
        completions = [Completion.model_construct(token_ids=s.tokens, logprobs=s.logprobs, versions=s.versions,
                                                  finish_reason=s.finish or "abort") for s in req.seqs]
        if not req.seqs:  # aborted before admission
            completions = [Completion.model_construct(token_ids=[], logprobs=[], versions=[], finish_reason="abort")
                           for _ in range(req.params.n)]
        resp = GenerateResponse.model_construct(request_id=req.id, prompt_len=len(req.prompt),
                                                completions=completions)
        with self._cv:
            self._requests.pop(req.id, None)
        self.metrics.requests_finished += 1
        req.loop.call_soon_threadsafe(_resolve, req.future, resp)

    def fail_all(self, error: Exception) -> None:
        """After a step broke: every request in flight answered with the error, the batch emptied."""
        with self._cv:
            reqs = list(self._requests.values())
            self._requests.clear()
            self._waiting.clear()
            self._incoming.clear()
        self._running.clear()
        self._reserved_tokens = 0
        self._batch = None
        for r in reqs:
            err = ContractError(500, f"engine step failed: {type(error).__name__}: {error}", type="engine_error")
            r.loop.call_soon_threadsafe(_reject, r.future, err)


def _resolve(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)


def _reject(future: asyncio.Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)
