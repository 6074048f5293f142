"""Runs inside vLLM's worker process (`--worker-extension-cls`): joins the trainer's weight-update group,
receives broadcast weights in pipelinerl's wire format, and loads them into the running model.

vLLM mixes this class into its worker, so `self` is the worker and `self.model_runner` its model runner. The
front (`pipelinerl.engines.vllm.front`) calls the `pipelinerl_*` methods through vLLM's `POST /collective_rpc`,
which takes string arguments only: payloads are JSON strings, results JSON-able dicts.

Why the update is split in calls: a `collective_rpc` runs inside vLLM's engine loop, between two steps, and
generation stops while it runs. So receiving (the long part) happens on a thread of this process while vLLM
keeps decoding (`pipelinerl_start_receive`, then `pipelinerl_receive_status` polls), and only the switch
(`pipelinerl_switch`: `model_runner.reload_weights`) runs inside the engine loop, between two decode steps.
Running requests keep their KV cache, computed under the old weights.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import torch

from pipelinerl.weight_sync import (
    DTYPES,
    TensorSpec,
    WeightUpdateGroup,
    init_weight_update_group,
    receive_tensors,
    wire_buffers,
)

log = logging.getLogger(__name__)

EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


class _Receive:
    """One update being received on a thread: the staged tensors, or the error that ended it."""

    def __init__(self, names: list[str], apply: bool):
        self.names, self.apply = names, apply
        self.tensors: list[torch.Tensor] | None = None
        self.error: str | None = None
        self.started = time.perf_counter()
        self.seconds = 0.0
        self.done = threading.Event()


class PipelineRLWorkerExtension:
    """The `pipelinerl_*` methods vLLM's `/collective_rpc` calls on every worker (tensor parallel size 1)."""

    # --- group ---------------------------------------------------------------------------------------------

    def pipelinerl_init_group(self, payload: str) -> dict:
        """Join the group as rank `rank_offset` + this worker's rank; returns once every member joined."""
        req = json.loads(payload)
        old = getattr(self, "_pl_group", None)
        if old is not None:
            old.destroy()
        self._pl_group: WeightUpdateGroup | None = None
        rank = int(req["rank_offset"]) + int(getattr(self, "rank", 0))
        self._pl_group = init_weight_update_group(req["master_address"], int(req["master_port"]), rank,
                                                  int(req["world_size"]), req.get("backend", "gloo"),
                                                  req.get("group_name", "weight_update"),
                                                  float(req.get("timeout_s", 120.0)))
        return {"rank": rank}

    def pipelinerl_leave_group(self) -> dict:
        group = getattr(self, "_pl_group", None)
        if group is not None:
            group.destroy()
        self._pl_group = None
        return {}

    # --- update --------------------------------------------------------------------------------------------

    def pipelinerl_start_receive(self, payload: str) -> dict:
        """Start receiving an update on a thread and return at once, so vLLM keeps decoding meanwhile.

        `apply: false` drains a refused update: the tensors are received into scratch memory and dropped, so
        the trainer and the other engines are not left hanging in the broadcast."""
        req = json.loads(payload)
        group = getattr(self, "_pl_group", None)
        if group is None:
            raise RuntimeError("not in a weight-update group")
        pending = getattr(self, "_pl_receive", None)
        if pending is not None and not pending.done.is_set():
            raise RuntimeError("an update is already being received")
        specs = [TensorSpec(n, DTYPES[d], tuple(s)) for n, d, s in req["specs"]]
        bucket_bytes = int(req.get("bucket_bytes", 0))
        receive = _Receive([s.name for s in specs], bool(req.get("apply", True)))
        self._pl_receive = receive
        threading.Thread(target=self._pl_receive_thread, args=(group, specs, bucket_bytes, receive),
                         name="pipelinerl-receive", daemon=True).start()
        return {}

    def pipelinerl_receive_status(self) -> dict:
        receive = getattr(self, "_pl_receive", None)
        if receive is None:
            return {"done": True, "error": "no update in progress", "seconds": 0.0}
        return {"done": receive.done.is_set(), "error": receive.error, "seconds": receive.seconds}

    def pipelinerl_switch(self) -> dict:
        """Load the received tensors into the running model (between two engine steps)."""
        receive = getattr(self, "_pl_receive", None)
        if receive is None or not receive.done.is_set() or receive.error or receive.tensors is None:
            raise RuntimeError("no received update to switch to")
        self._pl_receive = None
        t0 = time.perf_counter()
        weights = self._pl_loadable(dict(zip(receive.names, receive.tensors)))
        self.model_runner.reload_weights(weights_iterator=iter(weights))
        _refresh_tied_heads(self.model_runner.get_model())
        return {"switch_s": time.perf_counter() - t0, "loaded": len(weights)}

    # --- internals -----------------------------------------------------------------------------------------

    def _pl_receive_thread(self, group: WeightUpdateGroup, specs: list[TensorSpec], bucket_bytes: int,
                           receive: _Receive) -> None:
        try:
            out = self._pl_staging(specs, bucket_bytes) if receive.apply else None
            receive.tensors = receive_tensors(group, specs, bucket_bytes, out)
        except Exception as e:  # reported through pipelinerl_receive_status
            log.exception("receiving a weight update failed")
            receive.error = f"{type(e).__name__}: {e}"
        receive.seconds = time.perf_counter() - receive.started
        receive.done.set()

    def _pl_staging(self, specs: list[TensorSpec], bucket_bytes: int) -> list[torch.Tensor]:
        """Receive buffers laid out as the wire lays them out (no unpacking copy), kept across updates of the
        same layout: steady-state updates allocate nothing. Safe to reuse: an update is switched (and its
        tensors copied into the model) before the next one starts."""
        key = (tuple(specs), bucket_bytes)
        cached = getattr(self, "_pl_staging_cache", None)
        if cached is None or cached[0] != key:
            cached = (key, wire_buffers(specs, bucket_bytes, "cpu"))
            self._pl_staging_cache = cached
        return cached[1]

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
