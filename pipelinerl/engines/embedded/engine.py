"""The embedded engine: continuous batching on one thread, in-flight weight updates received beside it.

Data flow: HTTP handlers (asyncio) validate a request and queue it; the engine thread admits queued requests
between decode steps (prefill once per prompt, its KV cache copied to the n samples), decodes all running
sequences together, and resolves each request's future when its last sample ends (`Scheduler`, scheduler.py).
A weight update is received into a spare copy of the weights' storage while decoding goes on, by the engine's
`UpdateReceiver` (update_receivers.py): on CPU a process of its own, the weights in shared memory (no GIL shared
with decoding), on GPU a worker thread. The engine thread swaps spare and live storage at the next step boundary
(`WeightSwitch`, weight_switch.py; no copy: see `spare_weights`), so running sequences continue from their KV
cache under the new weights and every later token carries the new version.

`EmbeddedEngine` is the contract's side (`pipelinerl.contracts.routes.EngineBackend`): it checks requests and
updates, and runs the engine thread, which at every step boundary switches weights, then schedules.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pipelinerl.contracts.inference import (
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
from pipelinerl.contracts.routes import ContractError
from pipelinerl.engines.common import check_generate, check_update, completions_via_generate
from pipelinerl.engines.embedded.cpus import CpuSplit
from pipelinerl.engines.embedded.metrics import Metrics
from pipelinerl.engines.embedded.model_runner import make_runner
from pipelinerl.engines.embedded.sampling import SamplingBatch, sample_batch
from pipelinerl.engines.embedded.scheduler import AdmissionFailed, Request, Scheduler
from pipelinerl.engines.embedded.update_receivers import EngineSide, PendingSwitch, ProcessReceiver, make_receiver
from pipelinerl.engines.embedded.weight_switch import WeightSwitch
from pipelinerl.engines.stops import StopStrings, StopTokenizer
from pipelinerl.weight_sync import DTYPE_NAMES, DTYPES, TensorSpec, WeightSyncError

log = logging.getLogger(__name__)


@dataclass
class EngineSettings:
    max_running_seqs: int = 64
    max_batch_tokens: int = 16384
    max_model_len: int = 512
    initial_version: int = 0
    transposed_weights: str = "auto"  # SlotRunner's `transposed`: "auto", "all", "none" or "packed"
    # Where updates are received (update_receivers.py): "process" (no GIL shared with decoding; CPU only),
    # "thread" (a thread of the engine's process), "auto" (a process on CPU, a thread on GPU)
    update_receiver: str = "auto"


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
        self.metrics = Metrics()
        # One condition for the request queue, the pending weight switch and the engine thread's parking: the
        # engine thread waits on it for work, and a hand-over reads whether it is parked under it
        self._cv = threading.Condition()
        self.weights = WeightSwitch(self.runner, self.params, self.metrics, self._cv, settings.initial_version,
                                    self._cpus)
        self.scheduler = Scheduler(self.runner, settings.max_running_seqs, settings.max_batch_tokens, self.metrics,
                                   self._cv)
        # Chosen (and, for a process, the weights moved to shared memory) before decoding starts
        self.receiver = make_receiver(settings.update_receiver, EngineSide(
            self.params, self.runner, self.weights.spare, self._cpus,
            transposed_copies=self.weights.transposed_copies, busy=self.scheduler.busy,
            hand_over=self._hand_over, check_engine_thread=self._check_engine_thread))
        self.receive_in_process = isinstance(self.receiver, ProcessReceiver)
        self._update_lock = asyncio.Lock()
        self._parked = False  # the engine thread waits for work, holding nothing
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    @property
    def version(self) -> int:
        """The version of the weights decoding runs on."""
        return self.weights.version

    # --- contract: generation ------------------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        request = self._make_request(req)
        self.scheduler.submit(request)
        # Requests reach the engine thread once the event loop has run every task that is ready now: a burst
        # (asyncio.gather of a batch, the prompts of an actor step) is then admitted and prefilled as one batch.
        # Seen at once, a burst was admitted in two or three waves, each a separate prefill, with the sequences
        # out of step (the engine thread takes the GIL from the submitting loop). The first `wake` of a burst
        # hands over all of it; the others find nothing left.
        request.loop.call_soon(self.scheduler.wake)
        try:
            return await request.future
        except asyncio.CancelledError:  # the client went away: stop spending compute on it
            await self.abort(request.id)
            raise

    def _make_request(self, req: GenerateRequest) -> Request:
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
        return Request(id=req.request_id or uuid.uuid4().hex, prompt=list(prompt), params=params, max_new=max_new,
                       stop=frozenset(stop), stop_strings=stop_strings, loop=loop, future=loop.create_future())

    async def completions(self, req: CompletionsRequest) -> CompletionsResponse:
        return await completions_via_generate(req, self.tokenizer, self.model_name, self.generate)

    async def abort(self, request_id: str | None) -> list[str]:
        return self.scheduler.abort(request_id)

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
        self.weights.count_copies(pending)
        with self._cv:
            self.weights.pending = pending
            if self._parked:
                # Nothing is running and the engine thread cannot leave its wait while we hold the lock, so no
                # step can run: switch here, sparing two thread wake-ups (the engine thread's and ours).
                self.weights.switch(decoding=self.scheduler.decoding)
            else:
                self._cv.notify()

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
        running, waiting = self.scheduler.queue_lengths()
        return self.metrics.render(running, waiting, self.version, self.receiver.restarts)

    def shutdown(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout=10)
        self.weights.close()
        self.receiver.close()

    # --- the engine thread ---------------------------------------------------------------------------------

    def _loop(self) -> None:
        self._cpus.pin_decoding()
        scheduler, weights = self.scheduler, self.weights
        while True:
            with self._cv:
                while not (scheduler.has_work() or weights.has_work() or self._stopped):
                    self._parked = True  # see _hand_over
                    self._cv.wait()
                self._parked = False
                if self._stopped:
                    return
            try:
                weights.switch(decoding=scheduler.decoding)
                weights.take_copies_after()
                scheduler.step(weights.version)
            except AdmissionFailed as e:  # one of the requests admitted together may be the cause: find it
                log.warning("admitting %d request(s) failed (%s: %s); admitting them one at a time",
                            len(e.batch), type(e.__cause__).__name__, e.__cause__)
                scheduler.isolate(e.batch, e.__cause__)
            except Exception as e:  # keep serving: fail what was in flight, reset, go on
                log.exception("engine step failed")
                scheduler.fail_all(e)


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


def _eos_ids(model: torch.nn.Module) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            ids |= set(eos) if isinstance(eos, list) else {int(eos)}
    return ids
