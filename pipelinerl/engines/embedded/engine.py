"""The embedded engine: continuous batching on one thread, in-flight weight updates received beside it.

Data flow: HTTP handlers (asyncio) validate a request and queue it; the engine thread admits queued requests
between decode steps (prefill once per prompt, its KV cache copied to the n samples), decodes all running
sequences together, and resolves each request's future when its last sample ends. A weight update is received
into a spare copy of the weights' storage while decoding goes on, by the engine's `UpdateReceiver`
(receiving.py): on CPU a process of its own, the weights in shared memory (no GIL shared with decoding), on GPU
a worker thread. The engine thread swaps spare and live storage at the next step boundary (no copy: see
`spare_weights`), so running sequences continue from their KV cache under the new weights and every later
token carries the new version.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from pipelinerl.contracts.inference import (
    Completion,
    CompletionsRequest,
    CompletionsResponse,
    GenerateRequest,
    GenerateResponse,
    InfoResponse,
    InitWeightUpdateGroupRequest,
    SamplingParams,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
    WeightsChecksumResponse,
)
from pipelinerl.contracts.routes import ContractError, render_metrics
from pipelinerl.engines.common import check_generate, check_update, completions_via_generate
from pipelinerl.engines.embedded.cpus import CpuSplit
from pipelinerl.engines.embedded.model_runner import copy_slot, make_runner
from pipelinerl.engines.embedded.receiving import EngineSide, PendingSwitch, ProcessReceiver, make_receiver
from pipelinerl.engines.embedded.sampling import SamplingBatch, sample_batch
from pipelinerl.engines.embedded.spare_weights import SpareWeights
from pipelinerl.engines.stops import StopStrings, StopTokenizer, StopWatch
from pipelinerl.weight_sync import DTYPE_NAMES, DTYPES, TensorSpec, WeightSyncError

log = logging.getLogger(__name__)


@dataclass
class EngineSettings:
    max_running_seqs: int = 64
    max_batch_tokens: int = 16384
    max_model_len: int = 512
    initial_version: int = 0
    transposed_weights: str = "auto"  # SlotRunner's `transposed`: "auto", "all", "none" or "packed"
    # Where updates are received (receiving.py): "process" (no GIL shared with decoding; CPU only), "thread" (a
    # thread of the engine's process), "auto" (a process on CPU, a thread on GPU)
    update_receiver: str = "auto"


@dataclass(eq=False)
class _Request:
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
    # admitted alone: its admission with others failed, so it is tried by itself (see `_isolate`)
    alone: bool = False
    error: ContractError | None = None  # set when this request alone broke a step: answered with it


@dataclass(eq=False)
class _Seq:
    req: _Request
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


class Metrics:
    def __init__(self) -> None:
        self.generated_tokens = 0
        self.decode_steps = 0
        self.decode_seconds = 0.0
        self.requests_finished = 0
        self.admissions = 0  # batched prefills of newly admitted requests
        self.updates = 0
        self.updates_while_running = 0
        self.update_bytes = 0
        self.update_receive_seconds = 0.0
        self.update_switch_seconds = 0.0
        self.refused_updates = 0
        self.last_update_bytes = 0
        self.last_update_receive_seconds = 0.0
        self.last_update_switch_seconds = 0.0
        self.relayouts = 0  # updates whose weights were copied transposed before the switch
        self.relayout_seconds = 0.0
        self.started = time.monotonic()


class EmbeddedEngine:
    """Implements `pipelinerl.contracts.routes.EngineBackend` for a transformers causal LM."""

    def __init__(self, model: torch.nn.Module, model_name: str, settings: EngineSettings, tokenizer=None,
                 cpus: CpuSplit | None = None):
        self.model = model.eval()
        self.model_name = model_name
        self.settings = settings
        self.tokenizer = tokenizer
        # stop strings are matched on the engine thread, with what it needs of the tokenizer worked out once
        self._stop_tokenizer = StopTokenizer(tokenizer) if tokenizer is not None else None
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self._cpus = cpus or CpuSplit()  # where decoding and receiving run (cpus.py); default: anywhere
        self.runner = make_runner(model, settings.max_running_seqs, settings.max_model_len,
                                  settings.transposed_weights)
        if hasattr(self.runner, "linear_kernels"):
            log.info("linear kernels (timed on this machine): %s", self.runner.linear_kernels)
        self.eos_ids = _eos_ids(model)
        self.params = dict(model.named_parameters(remove_duplicate=False))
        # what an update is checked against (common.check_update): tied parameters under each of their names
        self._param_facts = {n: (DTYPE_NAMES.get(p.dtype), list(p.shape)) for n, p in self.params.items()}
        self.version = settings.initial_version
        self.metrics = Metrics()
        self._spare = SpareWeights(self.params, getattr(self.runner, "fused_groups", []))
        # Where the runner multiplies by transposed copies of weights (CPU), the copies of an update that arrived
        # while nothing was decoding are built on this thread after the switch (see ThreadReceiver._receive)
        self._copier = None
        if getattr(self.runner, "relayout_slots", None):
            self._copier = ThreadPoolExecutor(1, "engine-relayout", initializer=self._cpus.pin_transfer)
        # Chosen (and, for a process, the weights moved to shared memory) before decoding starts
        self.receiver = make_receiver(settings.update_receiver, EngineSide(
            self.params, self.runner, self._spare, self._cpus, transposed_copies=self._copier is not None,
            busy=self._busy, hand_over=self._hand_over, check_engine_thread=self._check_engine_thread))
        self.receive_in_process = isinstance(self.receiver, ProcessReceiver)
        self._update_lock = asyncio.Lock()
        self._cv = threading.Condition()
        self._waiting: deque[_Request] = deque()
        self._incoming: list[_Request] = []  # submitted, handed to the engine thread by `_wake`
        self._requests: dict[str, _Request] = {}
        self._running: list[_Seq] = []
        self._reserved_tokens = 0
        self._pending: PendingSwitch | None = None
        self._parked = False  # the engine thread waits for work, holding nothing
        self._abort_flag = False
        self._stopped = False
        self._batch: _DecodeBatch | None = None
        # copies being built after a switch (when idle: see ThreadReceiver._receive): (version, slots, their future)
        self._copies_after: tuple[int, list[int], Future] | None = None
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    # --- contract: generation ------------------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        request = self._make_request(req)
        with self._cv:
            if request.id in self._requests:
                raise ContractError(409, f"request_id {request.id!r} is already running", "request_id")
            self._requests[request.id] = request
            self._incoming.append(request)
        # Requests reach the engine thread once the event loop has run every task that is ready now: a burst
        # (asyncio.gather of a batch, the prompts of an actor step) is then admitted and prefilled as one batch.
        # Seen at once, a burst was admitted in two or three waves, each a separate prefill, with the sequences
        # out of step (the engine thread takes the GIL from the submitting loop). The first `_wake` of a burst
        # hands over all of it; the others find nothing left.
        request.loop.call_soon(self._wake)
        try:
            return await request.future
        except asyncio.CancelledError:  # the client went away: stop spending compute on it
            await self.abort(request.id)
            raise

    def _make_request(self, req: GenerateRequest) -> _Request:
        s, prompt, params = self.settings, req.prompt_token_ids, req.sampling
        max_new = check_generate(req, self.vocab_size, s.max_model_len, s.max_running_seqs, self.tokenizer)
        if params.n * (len(prompt) + max_new) > s.max_batch_tokens:
            raise ContractError(400, f"sampling.n: {params.n} x {len(prompt) + max_new} tokens exceed "
                                     f"max_batch_tokens {s.max_batch_tokens}", "sampling.n")
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop |= self.eos_ids
        # check_generate refused stop strings without a tokenizer
        stop_strings = StopStrings(params.stop, self._stop_tokenizer) if params.stop else None
        _probe_sampling(params)
        loop = asyncio.get_running_loop()
        return _Request(id=req.request_id or uuid.uuid4().hex, prompt=list(prompt), params=params, max_new=max_new,
                        stop=frozenset(stop), stop_strings=stop_strings, loop=loop, future=loop.create_future())

    def _wake(self) -> None:
        with self._cv:
            if not self._incoming:
                return
            self._waiting.extend(self._incoming)
            self._abort_flag |= any(r.aborted for r in self._incoming)  # aborted before the engine saw them
            self._incoming.clear()
            self._cv.notify()

    async def completions(self, req: CompletionsRequest) -> CompletionsResponse:
        return await completions_via_generate(req, self.tokenizer, self.model_name, self.generate)

    async def abort(self, request_id: str | None) -> list[str]:
        with self._cv:
            targets = list(self._requests.values()) if request_id is None else (
                [self._requests[request_id]] if request_id in self._requests else [])
            for r in targets:
                r.aborted = True
            self._abort_flag = bool(targets) or self._abort_flag
            self._cv.notify()
        return [r.id for r in targets]

    # --- contract: weight updates, received by `self.receiver` ---------------------------------------------

    async def init_weight_update_group(self, req: InitWeightUpdateGroupRequest) -> None:
        if req.backend == "nccl" and not torch.cuda.is_available():
            raise ContractError(400, "backend 'nccl' needs a GPU; use 'gloo' on CPU", "backend")
        async with self._update_lock:
            with _weight_sync_errors():
                await self.receiver.join(req)

    async def update_weights(self, req: UpdateWeightsRequest) -> UpdateWeightsResponse:
        async with self._update_lock:
            if self.receiver.group_name != req.group_name:
                raise ContractError(409, f"not in weight-update group {req.group_name!r}; call "
                                         "/v1/weights/init_group first", "group_name", "conflict")
            specs = [TensorSpec(p.name, DTYPES[p.dtype], tuple(p.shape)) for p in req.params]
            t0 = time.perf_counter()
            problem = check_update(req.params, self._param_facts)
            if problem is not None:
                # Drain the broadcast so the trainer and the other engines are not left hanging, but write
                # nothing into the model.
                with _weight_sync_errors():
                    await self.receiver.drain(specs, req.bucket_bytes)
                self.metrics.refused_updates += 1
                raise ContractError(400, problem[1], problem[0], "mismatched_update")
            pending = PendingSwitch(req.version, [s.name for s in specs])
            with _weight_sync_errors():
                received = await self.receiver.receive_and_switch(specs, req.bucket_bytes, pending)
            receive_s = received - t0
            nbytes = sum(s.nbytes for s in specs)
            m = self.metrics
            m.updates += 1
            m.update_bytes += nbytes
            m.update_receive_seconds += receive_s
            m.last_update_bytes, m.last_update_receive_seconds = nbytes, receive_s
            m.last_update_switch_seconds = pending.switch_s
            return UpdateWeightsResponse(version=req.version, received_bytes=nbytes, receive_s=receive_s,
                                         switch_s=pending.switch_s)

    def _hand_over(self, pending: PendingSwitch) -> None:
        """Have the engine thread switch to the received weights at its next step boundary (the receiver calls
        this, on whatever thread it received on, then waits for `pending.done` or `pending.on_done`)."""
        if pending.changes_copies:
            self.metrics.relayouts += not pending.copies_after  # all built before the switch
            self.metrics.relayout_seconds += pending.copy_seconds
        with self._cv:
            self._pending = pending
            if self._parked:
                # Nothing is running and the engine thread cannot leave its wait while we hold the lock, so no
                # step can run: switch here, sparing two thread wake-ups (the engine thread's and ours).
                self._switch_weights()
            else:
                self._cv.notify()

    def _busy(self) -> bool:
        with self._cv:
            return bool(self._running or self._waiting or self._incoming)

    def _check_engine_thread(self) -> None:
        if not self._thread.is_alive():
            raise ContractError(500, "engine thread died before switching weights", type="engine_error")

    # --- contract: the rest --------------------------------------------------------------------------------

    def info(self) -> InfoResponse:
        return InfoResponse(engine="embedded", model=self.model_name, weight_version=self.version,
                            max_model_len=self.settings.max_model_len, vocab_size=self.vocab_size,
                            max_running_seqs=self.settings.max_running_seqs, eos_token_ids=sorted(self.eos_ids),
                            weight_group=self.receiver.group_name)

    async def weights_checksum(self) -> WeightsChecksumResponse:
        # Read between steps would need the engine thread; a switch is one copy per tensor under the update
        # lock, so holding that lock gives a consistent snapshot.
        async with self._update_lock:
            return WeightsChecksumResponse(version=self.version,
                                           checksums=await asyncio.to_thread(tensor_checksums, self.params))

    def metrics_text(self) -> str:
        m = self.metrics
        with self._cv:
            running, waiting = len(self._running), len(self._waiting) + len(self._incoming)
        rows = [
            ("running_seqs", "gauge", running, "sequences being decoded"),
            ("waiting_requests", "gauge", waiting, "requests queued for admission"),
            ("weight_version", "gauge", self.version, "current weight version"),
            ("generated_tokens_total", "counter", m.generated_tokens, "tokens generated"),
            ("decode_steps_total", "counter", m.decode_steps, "batched decode steps"),
            ("decode_seconds_total", "counter", m.decode_seconds, "time spent in decode steps"),
            ("tokens_per_second", "gauge", m.generated_tokens / max(m.decode_seconds, 1e-9),
             "generated tokens per second of decoding"),
            ("requests_finished_total", "counter", m.requests_finished, "requests completed"),
            ("admissions_total", "counter", m.admissions, "batches of requests admitted, each one prefill"),
            ("weight_updates_total", "counter", m.updates, "weight updates applied"),
            ("weight_updates_while_running_total", "counter", m.updates_while_running,
             "updates applied while sequences were running"),
            ("weight_updates_refused_total", "counter", m.refused_updates, "mismatched updates refused"),
            ("weight_update_bytes_total", "counter", m.update_bytes, "bytes received by updates"),
            ("weight_update_receive_seconds_total", "counter", m.update_receive_seconds, "time receiving"),
            ("weight_update_switch_seconds_total", "counter", m.update_switch_seconds,
             "decode time lost to switching weights"),
            ("last_weight_update_bytes", "gauge", m.last_update_bytes, "bytes of the last update"),
            ("last_weight_update_receive_seconds", "gauge", m.last_update_receive_seconds,
             "seconds receiving the last update"),
            ("last_weight_update_switch_seconds", "gauge", m.last_update_switch_seconds,
             "decode pause for the last update"),
            ("weight_relayouts_total", "counter", m.relayouts,
             "updates whose weights were copied transposed (for faster matmuls) before the switch"),
            ("weight_relayout_seconds_total", "counter", m.relayout_seconds,
             "time spent copying received weights transposed, on the receiving CPUs"),
            ("weight_receiver_restarts_total", "counter", self.receiver.restarts,
             "weight-receiving processes that died and were replaced"),
        ]
        return render_metrics(rows)

    def shutdown(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout=10)
        if self._copier is not None:
            self._copier.shutdown(wait=True, cancel_futures=True)
        self.receiver.close()

    # --- the engine thread ---------------------------------------------------------------------------------

    def _loop(self) -> None:
        self._cpus.pin_decoding()
        while True:
            with self._cv:
                while not (self._running or self._waiting or self._pending or self._abort_flag or self._stopped
                           or self._copies_after is not None and self._copies_after[2].done()):
                    self._parked = True  # see _hand_over
                    self._cv.wait()
                self._parked = False
                if self._stopped:
                    return
            try:
                self._switch_weights()
                self._take_copies_after()
                self._handle_aborts()
                self._admit()
                if self._running:
                    self._decode_step()
            except _AdmissionFailed as e:  # one of the requests admitted together may be the cause: find it
                log.warning("admitting %d request(s) failed (%s: %s); admitting them one at a time",
                            len(e.batch), type(e.__cause__).__name__, e.__cause__)
                self._isolate(e.batch, e.__cause__)
            except Exception as e:  # keep serving: fail what was in flight, reset, go on
                log.exception("engine step failed")
                self._fail_all(e)

    def _switch_weights(self) -> None:
        pending = self._pending
        if pending is None:
            return
        t0 = time.perf_counter()
        if self._copies_after is not None:  # copies still being built after an earlier switch
            _, slots, future = self._copies_after
            self._copies_after = None
            if not set(slots) <= {*pending.copies, *pending.stale_copies, *pending.copies_after}:
                self.runner.use_copies(future.result())  # some stay current after this switch: wait for them
        self._spare.switch(pending.names)
        self.version = pending.version
        if pending.copies:
            self.runner.use_copies(pending.copies, foreign=pending.foreign_copies)
        if pending.stale_copies:  # only a partial update of a fused weight: rebuilt here, in the decode pause
            self.runner.use_copies(self.runner.build_copies(self._live(pending.stale_copies)))
        if pending.copies_after:  # the live weights until their copies are built (and still current)
            self.runner.use_copies(self._live(pending.copies_after))
            future = self._copier.submit(self._build_copies_after, self._live(pending.copies_after))
            self._copies_after = (self.version, pending.copies_after, future)
            future.add_done_callback(self._notify_engine)  # to take them into use even while idle
        pending.switch_s = time.perf_counter() - t0
        self.metrics.update_switch_seconds += pending.switch_s
        if self._running:
            self.metrics.updates_while_running += 1
        with self._cv:
            self._pending = None
        pending.done.set()
        if pending.on_done is not None:
            pending.on_done()

    def _live(self, slots: list[int]) -> dict[int, torch.Tensor]:
        return {slot: self.runner.relayout_slots[slot][2] for slot in slots}

    def _build_copies_after(self, live: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        t0 = time.perf_counter()
        copies = self.runner.build_copies(live)
        self.metrics.relayout_seconds += time.perf_counter() - t0
        return copies

    def _notify_engine(self, _: object = None) -> None:
        with self._cv:
            self._cv.notify()

    def _take_copies_after(self) -> None:
        """Copies built after a switch, taken into use once ready, unless a newer switch came first."""
        if self._copies_after is None or not self._copies_after[2].done():
            return
        (version, _, future), self._copies_after = self._copies_after, None
        if version == self.version and future.exception() is None:
            self.runner.use_copies(future.result())
            self.metrics.relayouts += 1

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

    def _admit(self) -> None:
        """Admit the queued requests that fit, prefilling their prompts together. A failure before the new
        sequences produced their first token is raised as `_AdmissionFailed`, with the running batch as it was."""
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
            raise _AdmissionFailed(batch) from e
        self._running.extend(seqs)
        self._batch = None
        self._append(seqs, tokens.tolist(), logprobs.tolist())

    def _isolate(self, batch: list[_Request], error: BaseException) -> None:
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

    def _take_admissible(self) -> list[_Request]:
        """Pop the queued requests that fit the running limits, in order, and reserve their tokens."""
        s = self.settings
        batch: list[_Request] = []
        running = len(self._running)
        with self._cv:
            while self._waiting:
                req = self._waiting[0]
                need = req.params.n * (len(req.prompt) + req.max_new)
                if running + req.params.n > s.max_running_seqs or (
                        running and self._reserved_tokens + need > s.max_batch_tokens):
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

    def _decode_step(self) -> None:
        t0 = time.perf_counter()
        batch = self._decode_batch()
        logits = self.runner.decode(batch.tokens, batch.positions, batch.span)
        try:
            tokens, logprobs = sample_batch(logits, batch.sampling)
        except Exception as e:  # per-row parameters broke the batched sampling: sample row by row, fail the bad
            self._sample_each(logits, e)
            return
        batch.advance(tokens)
        self.metrics.decode_steps += 1  # before `_append` answers finished requests
        self._append(self._running, tokens.tolist(), logprobs.tolist())  # a retirement drops the batch
        self.metrics.decode_seconds += time.perf_counter() - t0

    def _sample_each(self, logits: torch.Tensor, error: Exception) -> None:
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
        self._append([s for s, _, _ in keep], [t for _, t, _ in keep], [lp for _, _, lp in keep])
        for req, e in bad.values():
            req.error = ContractError(500, f"this request could not be sampled: {type(e).__name__}: {e}",
                                      type="engine_error")
            for seq in req.seqs:
                seq.finish = seq.finish or "abort"
            self._retire([seq for seq in req.seqs if seq in self._running])

    def _append(self, seqs: list[_Seq], tokens: list[int], logprobs: list[float]) -> None:
        version = self.version
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

    def _finish_request(self, req: _Request) -> None:
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

    def _fail_all(self, error: Exception) -> None:
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


class _AdmissionFailed(Exception):
    """Admitting `batch` together failed (the cause is chained); nothing of it is running."""

    def __init__(self, batch: list[_Request]):
        super().__init__(f"admitting {len(batch)} request(s) failed")
        self.batch = batch


def _probe_sampling(params: SamplingParams) -> None:
    """Raise the contract's 400 when this request's sampling parameters cannot be sampled with: its rows built and
    sampled alone, on two-token logits, before the request can share a batch with anyone's."""
    n = params.n
    generators = [None] * n
    if params.seed is not None:
        generators = [torch.Generator().manual_seed(params.seed + i) for i in range(n)]
    try:
        probe = SamplingBatch.of([params.temperature] * n, [params.top_k] * n, [params.top_p] * n, generators)
        sample_batch(torch.zeros(n, 2), probe)
    except (RuntimeError, ValueError, OverflowError, TypeError) as e:
        raise ContractError(400, f"sampling: these parameters cannot be sampled with ({type(e).__name__}: {e})",
                            "sampling") from None


def tensor_checksums(named: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()
            for name, t in named.items()}


@contextlib.contextmanager
def _weight_sync_errors() -> Iterator[None]:
    """A failed transfer (a peer gone, a timeout) as the contract's 504."""
    try:
        yield
    except WeightSyncError as e:
        raise ContractError(504, str(e), type="weight_sync_error") from None


def _resolve(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)


def _reject(future: asyncio.Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)


def _eos_ids(model: torch.nn.Module) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            ids |= set(eos) if isinstance(eos, list) else {int(eos)}
    return ids
