"""Runs inside vLLM's worker process (`--worker-extension-cls`): joins the trainer's weight-update group,
receives broadcast weights in pipelinerl's wire format, and loads them into the running model.

vLLM mixes this class into its worker, so `self` is the worker and `self.model_runner` its model runner. The
front (`pipelinerl.engines.vllm.front`) calls the `pipelinerl_*` methods through vLLM's `POST /collective_rpc`,
which takes string arguments only: payloads are JSON strings, results JSON-able dicts.

Why the update is split in calls: a `collective_rpc` runs inside vLLM's engine loop, between two steps, and
generation stops while it runs. So receiving (the long part) happens on a thread of this process while vLLM
keeps decoding (`pipelinerl_start_receive`; the thread tells the front when it is done over a loopback socket,
and `pipelinerl_receive_status` answers where that notice is late), and only the switch
(`pipelinerl_switch`: `model_runner.reload_weights`) runs inside the engine loop, between two decode steps.
Running requests keep their KV cache, computed under the old weights.

Why not vLLM's layerwise reload fed bucket by bucket as the update arrives (what vLLM's own NCCL weight
transfer does): `initialize_layerwise_reload` (vllm/model_executor/model_loader/reload/layerwise.py, 0.32)
moves every layer's parameters to the meta device until that layer's last weight is loaded, so the model cannot
run a step from the first bucket to the last: generation would stop for the whole transfer. Staging the update
and reloading it in one go keeps the stop to the reload.

How an update is taken (`update_mode`):
- staged on the GPU ("gpu", a GPU group whose update fits in the GPU's free memory): each bucket is received in
  place, with no copy, while vLLM decodes, and the switch copies GPU to GPU. That costs GPU memory outside vLLM's
  share (`--gpu-memory-utilization`) equal to the whole update, on every worker: the wire carries full checkpoint
  tensors and vLLM's weight loaders cut each worker's shard out of them at the switch, so a tensor-parallel worker
  stages the full model too.
- streamed ("stream", a GPU group whose update does not fit): generation pauses, and the update goes bucket by
  bucket straight into the weights through vLLM's layerwise reload (what vLLM's own NCCL weight transfer does),
  in `PIPELINE_DEPTH` buckets of GPU memory and none of the host's. The pause is the transfer, a few seconds at
  32B; staging it instead would take the whole update per worker in page-locked host memory: at 32B with tensor
  parallel 2, 8 workers x 65 GB = 520 GB on one engine node, more than such nodes can lock. Only a complete update
  can be streamed (a layer is rebuilt from all of its weights); a failure midway leaves some layers new and the
  rest old, and the front then refuses to generate (409) until the next complete update lands.
- staged in host memory ("cpu"): on CPU (gloo) always; on a GPU only when asked (page-locked: one DMA each way).
`PIPELINERL_VLLM_STAGING=gpu|cpu|stream` forces one.

Tensor parallelism: vLLM calls every method on every worker; worker w of an engine is rank `rank_offset + w`
of the group, receives the full tensors and loads its shard (the reload runs vLLM's weight loaders, which
shard by tensor-parallel rank).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pipelinerl.weight_sync import (
    DTYPES,
    TensorSpec,
    WeightUpdateGroup,
    drain,
    join_weight_update_group,
    receive_stream,
    receive_tensors,
    wire_buffers,
)

# A child of vLLM's logger: vLLM's worker processes configure only that one, so its messages (the staging choice,
# receive errors) appear in the engine's log beside vLLM's, at INFO too.
log = logging.getLogger(f"vllm.{__name__}")

EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
STAGING_ENV = "PIPELINERL_VLLM_STAGING"  # auto (default) | gpu | cpu | stream
STAGING_CHOICES = ("auto", "gpu", "cpu", "stream")
# GPU memory an update staged on the GPU must leave free beyond itself: the reload materialises one layer at a
# time in fresh memory before copying it into the running weights (twice the largest tensor covers a layer of
# this shape family), plus room for NCCL's and the allocator's own needs.
STAGING_SLACK_BYTES = 1 << 30


def update_mode(group_device: torch.device, update_bytes: int, largest_bytes: int, free_bytes: int | None,
                choice: str = "auto") -> str:
    """How to take an update of `update_bytes` (largest tensor `largest_bytes`) received over a group whose
    tensors land on `group_device`, with `free_bytes` free on that device (None: unknown): "gpu", "cpu" (staged
    there) or "stream" (see the module docstring).

    auto: a GPU group stages on its GPU when the update fits with room to spare, else streams; a CPU group stages
    in host memory. `choice` forces one ("gpu" on a CPU group stages in host memory: there is no GPU)."""
    if choice not in STAGING_CHOICES:
        raise ValueError(f"{STAGING_ENV}={choice!r}: must be one of {', '.join(STAGING_CHOICES)}")
    if choice == "stream":
        return "stream"
    if group_device.type == "cpu" or choice == "cpu":
        return "cpu"
    if choice == "gpu":
        return "gpu"
    fits = free_bytes is not None and update_bytes + 2 * largest_bytes + STAGING_SLACK_BYTES <= free_bytes
    return "gpu" if fits else "stream"


def staging_device(group_device: torch.device, update_bytes: int, largest_bytes: int, free_bytes: int | None,
                   choice: str = "auto") -> torch.device:
    """Where a staged update goes (`update_mode` "gpu" or "cpu"; a "stream" is never staged)."""
    mode = update_mode(group_device, update_bytes, largest_bytes, free_bytes, choice)
    return group_device if mode == "gpu" else torch.device("cpu")


def group_rank(rank_offset: int, worker: int, workers: int, world_size: int) -> int:
    """This worker's rank in the weight-update group: the engine's ranks are rank_offset .. rank_offset +
    workers - 1, one per worker. Raises ValueError when the group has no room for all of them."""
    if not 0 <= worker < workers:
        raise ValueError(f"worker {worker} is outside this engine's {workers} workers")
    if rank_offset + workers > world_size:
        raise ValueError(f"weight-update group of world_size {world_size} has no rank for the {workers} workers "
                         f"of this engine from rank_offset {rank_offset}: the trainer must count {workers} ranks "
                         f"per engine (its tensor parallel size)")
    return rank_offset + worker


class _Receive:
    """One update being received on a thread: the (name, tensor) pairs to load, or the error that ended it."""

    def __init__(self, names: list[str], apply: bool, notify: dict | None):
        self.names, self.apply = names, apply
        self.notify = notify  # {"port", "token"}: where the front waits for this receive's end
        self.loadable: list[tuple[str, torch.Tensor]] | None = None
        self.error: str | None = None
        self.started = time.perf_counter()
        self.seconds = 0.0
        self.done = threading.Event()

    def status(self) -> dict:
        """What `pipelinerl_receive_status` answers and the notice to the front carries."""
        return {"done": self.done.is_set(), "error": self.error, "seconds": self.seconds}


class _Join:
    """A join of the weight-update group under way on a thread of the worker."""

    def __init__(self, rank: int):
        self.rank = rank
        self.done = threading.Event()
        self.error: str | None = None
        self.abandoned = False


class PipelineRLWorkerExtension:
    """The `pipelinerl_*` methods vLLM's `/collective_rpc` calls on every worker (one per tensor-parallel rank)."""

    # --- group ---------------------------------------------------------------------------------------------

    def pipelinerl_init_group(self, payload: str) -> dict:
        """Start joining the group as rank `rank_offset` + this worker's rank, on a thread, and return at once:
        the rendezvous may wait long on its peers (or on an address that never answers), and a collective_rpc runs
        inside vLLM's engine loop, whose generation would stop meanwhile. The front polls
        `pipelinerl_join_status`; the join is bounded (join_weight_update_group), and one the front gives up on is
        left by `pipelinerl_abandon_join`."""
        req = json.loads(payload)
        pending = getattr(self, "_pl_join", None)
        if pending is not None and not pending.done.is_set():
            raise RuntimeError("a join of a weight-update group is already under way")
        old = getattr(self, "_pl_group", None)
        if old is not None:
            old.destroy()
        self._pl_group: WeightUpdateGroup | None = None
        self._pl_staging_cache = None  # staged on the old group's device
        # vLLM's rank of this worker among the engine's workers (tensor x pipeline parallel; no data parallel here)
        parallel = getattr(self, "parallel_config", None)
        workers = int(getattr(parallel, "world_size", 1) or 1)
        rank = group_rank(int(req["rank_offset"]), int(getattr(self, "rank", 0)), workers, int(req["world_size"]))
        join = self._pl_join = _Join(rank)

        def run() -> None:
            try:
                group = join_weight_update_group(req["master_address"], int(req["master_port"]), rank,
                                                 int(req["world_size"]), req.get("backend", "gloo"),
                                                 req.get("group_name", "weight_update"),
                                                 float(req.get("timeout_s", 120.0)))
            except Exception as e:  # reported through pipelinerl_join_status
                join.error = f"{type(e).__name__}: {e}"
            else:
                if join.abandoned:
                    group.destroy()
                else:
                    self._pl_group = group
            join.done.set()

        threading.Thread(target=run, name="pipelinerl-join", daemon=True).start()
        return {"rank": rank}

    def pipelinerl_join_status(self) -> dict:
        join = getattr(self, "_pl_join", None)
        if join is None:
            return {"done": True, "error": "no join under way", "rank": None}
        return {"done": join.done.is_set(), "error": join.error, "rank": join.rank}

    def pipelinerl_abandon_join(self) -> dict:
        """The front gave up on the join: the group it may still make is left, and the worker is in none."""
        join = getattr(self, "_pl_join", None)
        if join is not None:
            join.abandoned = True
            if join.done.is_set() and self._pl_group is not None:
                self._pl_group.destroy()
            self._pl_group = None
        return {}

    def pipelinerl_leave_group(self) -> dict:
        group = getattr(self, "_pl_group", None)
        if group is not None:
            group.destroy()
        self._pl_group = None
        return {}

    # --- update --------------------------------------------------------------------------------------------

    def _pl_update_request(self, payload: str) -> tuple[dict, Any, list[TensorSpec]]:
        """An update's request, this worker's group and the tensors' specs; refused outside a group or while
        another update is being received."""
        req = json.loads(payload)
        group = getattr(self, "_pl_group", None)
        if group is None:
            raise RuntimeError("not in a weight-update group")
        pending = getattr(self, "_pl_receive", None)
        if pending is not None and not pending.done.is_set():
            raise RuntimeError("an update is already being received")
        return req, group, [TensorSpec(n, DTYPES[d], tuple(s)) for n, d, s in req["specs"]]

    def pipelinerl_start_receive(self, payload: str) -> dict:
        """Start receiving an update on a thread and return at once, so vLLM keeps decoding meanwhile.

        `apply: false` drains a refused update: the tensors are received into scratch memory and dropped, so
        the trainer and the other engines are not left hanging in the broadcast."""
        req, group, specs = self._pl_update_request(payload)
        bucket_bytes = int(req.get("bucket_bytes", 0))
        receive = _Receive([s.name for s in specs], bool(req.get("apply", True)), req.get("notify"))
        self._pl_receive = receive
        threading.Thread(target=self._pl_receive_thread, args=(group, specs, bucket_bytes, receive),
                         name="pipelinerl-receive", daemon=True).start()
        return {}

    def pipelinerl_update_mode(self, payload: str) -> dict:
        """How this worker would take an update of these specs (`update_mode`), decided before any byte moves."""
        req = json.loads(payload)
        group = getattr(self, "_pl_group", None)
        if group is None:
            raise RuntimeError("not in a weight-update group")
        specs = [TensorSpec(n, DTYPES[d], tuple(s)) for n, d, s in req["specs"]]
        free = torch.cuda.mem_get_info(group.device)[0] if group.device.type == "cuda" else None
        mode = update_mode(group.device, sum(s.nbytes for s in specs), max((s.nbytes for s in specs), default=0),
                           free, os.environ.get(STAGING_ENV, "auto"))
        return {"mode": mode}

    def pipelinerl_receive_and_load(self, payload: str) -> dict:
        """A streamed update: receive it bucket by bucket straight into the running model through vLLM's
        layerwise reload, inside the engine loop (the front has paused generation). Every parameter must be in
        it (the front checks). On a failure midway the layers not yet rebuilt get their old tensors back, so the
        engine can run, with its weights partly new: the front stops generating until a complete update."""
        req, group, specs = self._pl_update_request(payload)
        names = [s.name for s in specs]
        tied = bool(getattr(self.model_runner.model_config.hf_config, "tie_word_embeddings", False))
        skip_head = tied and EMBED in names  # vLLM loads a tied head through the embedding only
        t0 = time.perf_counter()
        loaded = 0

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal loaded
            for i, tensor in receive_stream(group, specs, int(req.get("bucket_bytes", 0))):
                name = names[i]
                if name == LM_HEAD and tied:
                    if skip_head:
                        continue
                    name = EMBED
                loaded += 1
                # a copy: the layerwise reload keeps a layer's weights until the last of them arrives, and the
                # receive buffer is reused for a later bucket
                yield name, tensor.clone()

        self._pl_current = None  # a host copy of the weights (for partial staged updates) is out of date now
        try:
            self.model_runner.reload_weights(weights_iterator=weights())
        except Exception:
            log.exception("a streamed weight update failed midway; the layers not rebuilt keep their old weights")
            _restore_unfinished_layers(self.model_runner.get_model())
            raise
        _refresh_tied_heads(self.model_runner.get_model())
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # the reload's copies are done before generation resumes
        return {"switch_s": time.perf_counter() - t0, "loaded": loaded}

    def pipelinerl_receive_status(self) -> dict:
        receive = getattr(self, "_pl_receive", None)
        if receive is None:
            return {"done": True, "error": "no update in progress", "seconds": 0.0}
        return receive.status()

    def pipelinerl_switch(self) -> dict:
        """Load the received tensors into the running model (between two engine steps)."""
        receive = getattr(self, "_pl_receive", None)
        if receive is None or not receive.done.is_set() or receive.error or receive.loadable is None:
            raise RuntimeError("no received update to switch to")
        self._pl_receive = None
        t0 = time.perf_counter()
        self.model_runner.reload_weights(weights_iterator=iter(receive.loadable))
        _refresh_tied_heads(self.model_runner.get_model())
        if torch.cuda.is_available():
            # The reload's copies are queued on this thread's stream; the next update must not overwrite the
            # staging buffers they read before they ran (its receiving thread waits on this).
            self._pl_reloaded = torch.cuda.Event()
            self._pl_reloaded.record()
        return {"switch_s": time.perf_counter() - t0, "loaded": len(receive.loadable)}

    # --- internals -----------------------------------------------------------------------------------------

    def _pl_receive_thread(self, group: WeightUpdateGroup, specs: list[TensorSpec], bucket_bytes: int,
                           receive: _Receive) -> None:
        try:
            with self._pl_receive_stream(group):
                if receive.apply:
                    tensors = receive_tensors(group, specs, bucket_bytes,
                                              self._pl_staging(group, specs, bucket_bytes))
                else:  # drained bucket by bucket: a refused update takes two buckets of memory, not the update
                    drain(group, specs, bucket_bytes)
                    tensors = None
            if tensors is not None:
                # Worked out here rather than at the switch: copies for a partial update stay out of the pause
                receive.loadable = self._pl_loadable(dict(zip(receive.names, tensors)))
        except Exception as e:  # reported through pipelinerl_receive_status
            log.exception("receiving a weight update failed")
            receive.error = f"{type(e).__name__}: {e}"
        receive.seconds = time.perf_counter() - receive.started
        receive.done.set()
        if receive.notify:
            notify_front(receive.notify, int(getattr(self, "rank", 0)), receive.status())

    @contextlib.contextmanager
    def _pl_receive_stream(self, group: WeightUpdateGroup) -> Iterator[None]:
        """On a GPU group, receiving runs on a CUDA stream of its own, and the data is in place when this exits.

        ProcessGroupNCCL makes its stream wait for the caller's current stream before a broadcast, and `wait()`
        makes the caller's current stream wait for the broadcast. On this thread the current stream would be the
        device's default stream, the one vLLM decodes on: each bucket would hold decoding up until it arrived."""
        if group.device.type != "cuda":
            yield
            return
        torch.cuda.set_device(group.device)  # a new thread starts on GPU 0; this worker's may be another
        reloaded = getattr(self, "_pl_reloaded", None)
        if reloaded is not None:
            reloaded.synchronize()  # the last switch has read the staging buffers this update overwrites
        stream = getattr(self, "_pl_stream", None)
        if stream is None:
            stream = self._pl_stream = torch.cuda.Stream(group.device)
        with torch.cuda.stream(stream):
            yield
        stream.synchronize()  # whatever stream the switch reads the staged tensors from, they are there

    def _pl_staging(self, group: WeightUpdateGroup, specs: list[TensorSpec], bucket_bytes: int) -> list[torch.Tensor]:
        """Receive buffers laid out as the wire lays them out (received in place, no unpacking copy) on the
        device `staging_device` picks, kept across updates of the same layout: steady-state updates allocate
        nothing. Safe to reuse: an update is switched (and its tensors copied into the model) before the next
        one is received."""
        key = (tuple(specs), bucket_bytes, group.device)
        cached = getattr(self, "_pl_staging_cache", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        self._pl_staging_cache = None  # free the old buffers before sizing up the new ones
        free = None
        if group.device.type == "cuda":
            if cached is not None and cached[1] and cached[1][0].is_cuda:
                del cached
                torch.cuda.empty_cache()  # the old buffers back to the device, where mem_get_info counts them
            free = torch.cuda.mem_get_info(group.device)[0]
        update_bytes = sum(s.nbytes for s in specs)
        device = staging_device(group.device, update_bytes, max((s.nbytes for s in specs), default=0), free,
                                os.environ.get(STAGING_ENV, "auto"))
        buffers = wire_buffers(specs, bucket_bytes, device)
        pinned = _page_lock(buffers) if group.device.type == "cuda" and device.type == "cpu" else False
        log.info("staging weight updates of %.2f GiB on %s%s (free on %s: %s)", update_bytes / 2**30, device,
                 " (page-locked)" if pinned else "", group.device,
                 "n/a" if free is None else f"{free / 2**30:.2f} GiB")
        self._pl_staging_cache = (key, buffers, _PageLocked(buffers) if pinned else None)
        return buffers

    def _pl_loadable(self, update: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """The (name, tensor) pairs to give `reload_weights`: the whole model's weights in checkpoint names.

        vLLM's in-place reload rebuilds a fused layer (q/k/v, gate/up) only from what it is given, so an
        update covering part of the model is completed from a copy of the current weights (read from the
        checkpoint at the first partial update, then kept up to date). With tied embeddings vLLM loads the
        embedding only: `lm_head.weight` is sent as the embedding or dropped."""
        tied = bool(getattr(self.model_runner.model_config.hf_config, "tie_word_embeddings", False))
        if tied and LM_HEAD in update:
            head = update.pop(LM_HEAD)
            update.setdefault(EMBED, head)
        names = self._pl_param_names(tied)
        current = getattr(self, "_pl_current", None)
        if set(update) >= names:
            if current is not None:
                for name, t in update.items():
                    current[name].copy_(t)
            return list(update.items())
        if current is None:
            current = self._pl_current = _checkpoint_weights(self.model_runner.model_config.model, names,
                                                             self.model_runner.model_config.dtype)
        for name, t in update.items():
            current[name].copy_(t)
        return list(current.items())

    def _pl_param_names(self, tied: bool) -> set[str]:
        names = getattr(self, "_pl_names", None)
        if names is None:
            from transformers import AutoConfig, AutoModelForCausalLM

            config = AutoConfig.from_pretrained(self.model_runner.model_config.model)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
            names = {n for n, _ in model.named_parameters()}
            if tied:
                names.discard(LM_HEAD)
            self._pl_names = names
        return names


def notify_front(notify: dict, worker: int, status: dict) -> None:
    """Tell the front (`front.ReceiveNotices`, on this host) that this worker's receive ended. Best effort: a
    front that gets no notice asks for the status through the engine loop instead."""
    line = json.dumps({"token": notify["token"], "worker": worker, "status": status}) + "\n"
    try:
        with socket.create_connection(("127.0.0.1", int(notify["port"])), timeout=10.0) as conn:
            conn.sendall(line.encode())
    except OSError as e:
        log.warning("could not notify the front that the update was received (%s); it will ask instead", e)


def _storages(tensors: list[torch.Tensor]) -> dict[int, int]:
    """{data pointer: bytes} of the distinct storages under `tensors` (wire_buffers: one per bucket)."""
    out: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        out.setdefault(storage.data_ptr(), storage.nbytes())
    return out


def _page_lock(tensors: list[torch.Tensor]) -> bool:
    """Page-lock the host memory under `tensors` in place (cudaHostRegister), so copies between it and the GPU
    are single DMAs; False (and nothing locked) when the driver refuses, e.g. over the locked-memory limit."""
    cudart = torch.cuda.cudart()
    done: list[int] = []
    for ptr, nbytes in _storages(tensors).items():
        if nbytes and int(cudart.cudaHostRegister(ptr, nbytes, 0)) != 0:
            for p in done:
                cudart.cudaHostUnregister(p)
            log.warning("could not page-lock %.2f GiB of host memory for staging weight updates; using pageable "
                        "memory", sum(_storages(tensors).values()) / 2**30)
            return False
        done.append(ptr)
    return True


class _PageLocked:
    """Holds page-locked staging buffers and unregisters their memory when dropped: it holds the tensors
    itself, so the memory cannot be freed while still registered."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors
        self.ptrs = [p for p, n in _storages(tensors).items() if n]

    def __del__(self) -> None:
        cudart = torch.cuda.cudart()
        for p in self.ptrs:
            cudart.cudaHostUnregister(p)


def _restore_unfinished_layers(model: torch.nn.Module) -> None:
    """After a layerwise reload that stopped midway (vllm/model_executor/model_loader/reload/layerwise.py, 0.32):
    every layer still waiting for weights gets its kernel tensors (its old weights) back, as vLLM's own
    finalisation does for a layer that loaded nothing, instead of being rebuilt from part of its weights."""
    from vllm.model_executor.model_loader.reload import layerwise

    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    for layer in model.modules():
        info = layerwise.get_layerwise_info(layer)
        if not info.can_load():
            continue
        if info.kernel_tensors is not None:
            layerwise._place_kernel_tensors(layer, info)
        info.reset()
    layerwise.LOADING_LAYERS.clear()


def _refresh_tied_heads(model: torch.nn.Module) -> None:
    """Re-derive the kernels of LM heads that share the embedding's weight.

    On CPU vLLM computes logits with a packed copy of the LM head's weight made when it was loaded. A tied
    head is not loaded itself (its weight is the embedding's), so `reload_weights` updates the embedding but
    leaves the head's packed copy stale: logits would come from the old embedding."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    modules = list(model.modules())
    embeddings = {id(m.weight) for m in modules if not isinstance(m, ParallelLMHead) and hasattr(m, "weight")}
    for module in modules:
        method = getattr(module, "quant_method", None)
        if isinstance(module, ParallelLMHead) and method is not None and id(module.weight) in embeddings:
            method.process_weights_after_loading(module)


def _checkpoint_weights(model: str, names: set[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors named in `names`, in the served dtype."""
    from safetensors.torch import load_file

    path = Path(model)
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(model, local_files_only=True))
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        for name, t in load_file(str(file)).items():
            if name in names:
                out[name] = t.to(dtype)
    missing = names - set(out)
    if missing:
        raise RuntimeError(f"checkpoint {model} lacks {sorted(missing)[:5]}")
    return out


def rpc_payload(obj: Any) -> str:
    """The JSON string a `pipelinerl_*` method takes (collective_rpc passes strings only)."""
    return json.dumps(obj)
