"""The trainer's side of the weight path: full parameters out of however the model is held (whole, DeepSpeed
ZeRO-3 partitions, FSDP shards), in the order and memory layout the wire wants, broadcast to every engine.

`Trainer` builds one `WeightPublisher` and delegates `connect_engines`, `broadcast_weights` and `full_parameters`
to it; everything about the weight path on the trainer's side lives here (PipelineRL keeps the same split with
its weight-update manager, AReaL with `connect_engine`/`update_weights` on its train engine).

Memory, the reason for most of this module: a broadcast never holds the whole model beyond the trainer's own
state. An unsharded model is sent from its live parameters (laid out as the wire lays out an update when they
already are in the engines' dtype, so not even a packing copy is made). A sharded model is gathered one unit at a
time (a wire bucket, or with per-tensor broadcasts a group of tensors of about `GATHER_BYTES`), each unit packed
into the weight-update group's reused buffers in the engines' dtype, then released before the next is gathered:
the main rank's extra memory is one gathered unit plus `PIPELINE_DEPTH` packing buffers, the other ranks' one
gathered unit. Every rank of a sharded trainer walks the same units in the same order (gathering is collective);
only the main rank talks to engines.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from pipelinerl.config import WeightSyncConfig
from pipelinerl.contracts.trainer import BroadcastStats
from pipelinerl.engines.client import EngineClient, init_group_on_engines, send_update_and_broadcast
from pipelinerl.weight_sync import (
    TensorSpec,
    WeightUpdateGroup,
    adopt_wire_layout,
    broadcast_stream,
    broadcast_tensors,
    host_rendezvous,
    in_wire_layout,
    init_weight_update_group,
    plan_buckets,
    sibling_order,
)

log = logging.getLogger(__name__)

# Wrappers that rename parameters: DDP / DeepSpeed put the model under `module.`, torch.compile under
# `_orig_mod.`, FSDP1 and activation checkpointing insert a segment into every path.
_PREFIXES = ("module.", "_orig_mod.")
_SEGMENTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")
# A sharded model sent one tensor per broadcast (`bucket_mb: 0`, SGLang's format) is still gathered in units of
# about this many bytes, so that small tensors (norms, biases) do not each cost a collective.
GATHER_BYTES = 64 * 2**20


@functools.lru_cache(maxsize=65536)  # called for every parameter of every update; names repeat
def clean_name(name: str) -> str:
    """The Hugging Face name of a parameter seen through wrappers (`module.model.x` -> `model.x`)."""
    while name.startswith(_PREFIXES):
        name = name.split(".", 1)[1]
    return ".".join(part for part in name.split(".") if part not in _SEGMENTS)


@functools.lru_cache(maxsize=8)
def _wire_order(names: tuple[str, ...]) -> list[int]:
    return sibling_order(names)


def in_wire_order(named: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """`named` in the order updates send them (`sibling_order`: fused sibling projections arrive together)."""
    return [named[i] for i in _wire_order(tuple(n for n, _ in named))]


def full_shape(p: Tensor) -> tuple[int, ...]:
    """A parameter's shape in the full model, whatever holds it: a ZeRO-3 partition (`ds_shape`), an FSDP2
    DTensor (its global shape), or the tensor itself."""
    shape = getattr(p, "ds_shape", None)
    return tuple(shape) if shape is not None else tuple(p.shape)


class EngineWaitInterrupted(Exception):
    """A stop was asked for while the trainer waited for a dead engine to come back."""


class WeightPublisher:
    """Connects the trainer to engines and sends them its current weights.

    `sharding` is how the model's parameters are held: "none", "zero3" or "fsdp". `model` is the wrapped model
    (what FSDP's state-dict API takes), `module` the unwrapped one (whose parameters are walked)."""

    def __init__(self, model: nn.Module, module: nn.Module, sharding: str, weights_dtype: torch.dtype,
                 sync: WeightSyncConfig, is_main: bool):
        if sharding not in ("none", "zero3", "fsdp"):
            raise ValueError(f"sharding must be none, zero3 or fsdp, got {sharding!r}")
        self.model, self.module, self.sharding = model, module, sharding
        self.weights_dtype, self.sync, self.is_main = weights_dtype, sync, is_main
        self._clients: dict[str, EngineClient] = {}
        # (clean name, parameter) in wire order, walked once: the parameters stay the same objects for the whole
        # run (the optimizer holds them too), and walking the module tree again on every broadcast is latency
        # before the engines even hear of the update. Tied weights appear once.
        self.named = in_wire_order([(clean_name(n), p) for n, p in module.named_parameters()])
        self.specs = [TensorSpec(n, weights_dtype, full_shape(p)) for n, p in self.named]
        self._wire_flats: list[Tensor] = []  # see _keep_wire_layout
        self._wire_where: tuple[int, list[int]] | None = None
        self._state_dict_hook: Any = None

    @property
    def bucket_bytes(self) -> int:
        return int(self.sync.bucket_mb * 2**20)

    # --- engines ---------------------------------------------------------------------------------------------

    def client(self, url: str) -> EngineClient:
        if url not in self._clients:
            self._clients[url] = EngineClient(url)
        return self._clients[url]

    def connect(self, engine_urls: Sequence[str], ranks_per_engine: int = 1) -> WeightUpdateGroup | None:
        """Form the weight-update group with the engines (main rank = rank 0); other ranks get None.
        `ranks_per_engine`: the group ranks each engine brings (its tensor-parallel workers)."""
        if not self.is_main:
            return None
        s = self.sync
        world = 1 + ranks_per_engine * len(engine_urls)
        # master_port 0: listen first on a port the kernel picks, then tell the engines; a port chosen in
        # advance may be taken by someone else before we listen on it.
        store = host_rendezvous(s.master_address, world, s.timeout_s) if not s.master_port else None
        port = store.port if store is not None else s.master_port
        world, futures = init_group_on_engines([self.client(u) for u in engine_urls], s.master_address, port,
                                               s.backend, s.group_name, s.timeout_s, ranks_per_engine)
        group = init_weight_update_group(s.master_address, port, 0, world, s.backend, s.group_name, s.timeout_s,
                                         store=store)
        for f in futures:
            f.result()
        return group

    def ensure_engines(self, group: WeightUpdateGroup | None, engine_urls: Sequence[str], ranks_per_engine: int,
                       wait_s: float, should_stop: Callable[[], bool] = lambda: False, force: bool = False
                       ) -> tuple[WeightUpdateGroup | None, list[str]]:
        """Main rank, before a broadcast: if an engine does not answer its health check (it died; the launcher
        restarts it, `engine.max_restarts`), wait up to `wait_s` for every engine to answer, then form the
        weight-update group again with all of them (the survivors leave the old group when they join the new
        one). Returns the group to broadcast on and the URLs that were down (empty: nothing happened); the next
        broadcast brings the restarted engines to the current weights. Other ranks: (group, []). Raises
        `EngineWaitInterrupted` when `should_stop` says so while waiting."""
        if not self.is_main:
            return group, []
        down = [u for u in engine_urls if not self.client(u).health()]
        if not down and not force:  # `force`: a broadcast just failed, so re-form the group even if all answer
            return group, []
        log.warning("engine(s) %s not answering: waiting up to %g s for them to come back, then re-forming the "
                    "weight-update group", ", ".join(down), wait_s)
        deadline = time.monotonic() + wait_s
        while not all(self.client(u).health() for u in engine_urls):
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine(s) {', '.join(down)} did not come back within {wait_s:g} s "
                                   "(engine.restart_wait_s); see their logs in RUN_DIR/logs")
            if should_stop():
                raise EngineWaitInterrupted(f"stopped while waiting for engine(s) {', '.join(down)}")
            time.sleep(0.5)
        if group is not None:
            group.destroy()
        group = self.connect(engine_urls, ranks_per_engine)
        log.info("weight-update group re-formed with %d engine(s) after %s came back", len(engine_urls),
                 ", ".join(down))
        return group, down

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()

    def publish(self, group: WeightUpdateGroup | None, engine_urls: Sequence[str], version: int) -> BroadcastStats:
        """Send the current weights as `version` to every engine; return once all switched. Every trainer rank
        calls it (gathering sharded parameters is collective)."""
        start = time.perf_counter()
        bucket_bytes = self.bucket_bytes
        if not self.is_main:
            if self.sharding != "none":
                for _ in self._gathered(bucket_bytes):  # take part in every gather, send nothing
                    pass
            return BroadcastStats(version, 0, time.perf_counter() - start)
        if group is None:
            raise ValueError("the main process needs the weight-update group (see connect_engines)")
        if self.sharding == "none" and self._keep_wire_layout() is not None:  # sent from the live parameters
            live = [p.detach() for _, p in self.named]

            def send(ready: Callable[[], None]) -> int:
                return broadcast_tensors(group, live, bucket_bytes, ready)
        else:  # gathered, or converted to the engines' dtype, one bucket at a time while packing
            tensors = (p.detach() for _, p in self.named) if self.sharding == "none" else self._gathered(bucket_bytes)

            def send(ready: Callable[[], None]) -> int:
                return broadcast_stream(group, self.specs, tensors, bucket_bytes, ready)
        send_update_and_broadcast(group, [self.client(u) for u in engine_urls], self.specs, version, bucket_bytes,
                                  send)
        # the parameters' bytes (what the engines receive, without the wire's alignment padding)
        return BroadcastStats(version, sum(s.nbytes for s in self.specs), time.perf_counter() - start)

    # --- full parameters -------------------------------------------------------------------------------------

    def full_parameters(self, all_ranks: bool = False, device: torch.device | str | None = None
                        ) -> Iterator[tuple[str, Tensor]]:
        """(name, full tensor in the engines' dtype) for every parameter, in wire order, tied weights once.

        Every rank must iterate it when the model is sharded (gathering is collective); only the main rank gets
        tensors unless `all_ranks`. Each tensor is its own copy when sharded (on `device`, default where it was
        gathered); unsharded tensors are the live parameters when already in the engines' dtype and on `device`:
        use them before the next optimizer step."""
        keep = all_ranks or self.is_main
        if self.sharding == "none":
            if not keep:
                return
            for name, p in self.named:
                t = p.detach()
                yield name, t.to(device=device or t.device, dtype=self.weights_dtype)
            return
        tensors = self._gathered(0, all_ranks=all_ranks)
        for spec, t in zip(self.specs, tensors, strict=True):
            if keep:
                yield spec.name, t.to(device=device or t.device, dtype=self.weights_dtype, copy=True)

    def _gathered(self, bucket_bytes: int, all_ranks: bool = False) -> Iterator[Tensor]:
        """The full tensors of a sharded model in wire order (`self.specs`), gathered one unit at a time: a wire
        bucket, or groups of about GATHER_BYTES when sent per tensor. A tensor is valid until the next one of
        another unit is asked for (the unit's gathered memory is released then), so consumers copy it first.
        Ranks other than the main one (unless `all_ranks`) get no useful tensors but must iterate to the end."""
        units = plan_buckets(self.specs, bucket_bytes if bucket_bytes > 0 else GATHER_BYTES)
        if self.sharding == "zero3":
            yield from self._zero3_units(units)
        elif _is_fsdp2(self.module):
            for _, p in self.named:
                # DTensor.full_tensor is one all-gather; the result is freed once the consumer moved on
                yield p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        else:
            yield from self._fsdp1_tensors(all_ranks)

    def _zero3_units(self, units: list[list[int]]) -> Iterator[Tensor]:
        """ZeRO-3's full parameters, one unit at a time, gathered from every rank's partition (`ds_tensor`: rank r
        holds elements r * n .. (r + 1) * n of the parameter flattened and padded to a multiple of the ranks) with
        one all-gather per parameter on DeepSpeed's own group, ordered on the device, never waited for on the host.

        Why not `deepspeed.zero.GatheredParameters`: its gather ends in `get_accelerator().synchronize()` (DeepSpeed
        0.19.8, partition_parameters.py), a wait for every stream of the GPU, the weight-update group's broadcast of
        the previous bucket included: gathering the next unit could never overlap sending the last one, and the two
        packing buffers of `broadcast_stream` would buy nothing. Parameters whose partition is not on this rank's
        device (offload_param to CPU or NVMe) or is quantized are gathered by DeepSpeed as before. Set
        PIPELINERL_ZERO3_GATHER=deepspeed to gather everything that way."""
        import os

        import deepspeed

        direct = os.environ.get(ZERO3_GATHER_ENV, "direct") != "deepspeed"
        for unit in units:
            params = [self.named[i][1] for i in unit]
            if direct and all(_partition_on_device(p) for p in params):
                gathered = [_gather_partitions(p) for p in params]
                yield from gathered
                del gathered  # freed on the current stream: reused only after what was queued to read them
                continue
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                for p in params:
                    yield p.data  # the gathered storage is released when the context exits

    def _fsdp1_tensors(self, all_ranks: bool) -> Iterator[Tensor]:
        """FSDP1 (flat parameters): the full state dict through torch's API, offloaded to the main rank's CPU
        memory only (`cpu_offload`: the other ranks get nothing, no GPU holds the whole model). Per-tensor
        gathering, which FSDP2's DTensors allow, is not available for flat parameters."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True,
                                                                          cpu_offload=not all_ranks))
        state = {clean_name(k): v for k, v in state.items()}
        for spec in self.specs:
            t = state.pop(spec.name, None)
            yield t if t is not None else torch.empty(0)

    # --- the unsharded model's wire layout --------------------------------------------------------------------

    def lay_out_for_broadcast(self) -> bool:
        """Lay the parameters out for the bucket size now (the first bucketed broadcast does it otherwise);
        returns whether they moved. Main process only. See `_keep_wire_layout`."""
        return bool(self._keep_wire_layout())

    def _keep_wire_layout(self) -> bool | None:
        """Keep the live parameters laid out in memory as the wire format lays out an update (one flat buffer
        per `bucket_mb` bucket, each parameter a view into it), so each bucket is broadcast straight from the
        parameters' memory instead of being packed into a buffer first: a copy of the whole model per update
        saved, on the same cores that move the bytes. Re-laid only when the bucket size or device changed.

        Only where the broadcast tensors are the live parameters themselves (unsharded, already in the engines'
        dtype); parameters stay the same `nn.Parameter` objects, so the optimizer is unaffected. Returns whether
        the parameters moved, or None when they are not what is sent (sharded, or not in the engines' dtype)."""
        params = [p for _, p in self.named]
        if self.sharding != "none" or any(p.dtype != self.weights_dtype for p in params):
            return None
        if self.bucket_bytes <= 0 or any(p.device != params[0].device for p in params):
            return False
        where = (self.bucket_bytes, [p.data_ptr() for p in params])
        if where == self._wire_where:  # every update but the first: nothing moved since it was laid out
            return False
        moved = not in_wire_layout(params, self.bucket_bytes)
        if moved:
            self._wire_flats = adopt_wire_layout(params, self.bucket_bytes)
            log.info("parameters laid out for the wire: %d buckets of up to %g MB", len(self._wire_flats),
                     self.sync.bucket_mb)
            if self._state_dict_hook is None:
                self._state_dict_hook = self.module.register_state_dict_post_hook(
                    lambda _module, state_dict, _prefix, _meta: self._unalias_state_dict(state_dict))
        self._wire_where = (self.bucket_bytes, [p.data_ptr() for p in params])
        return moved

    def _unalias_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Give `state_dict()` its own copy of every parameter that shares a wire buffer: savers that
        deduplicate tensors by storage (accelerate's and safetensors') would otherwise keep one parameter per
        bucket and silently drop the rest. Tied names still share one copy."""
        flats = {f.untyped_storage().data_ptr() for f in self._wire_flats}
        copies: dict[tuple, Tensor] = {}
        for name, t in state_dict.items():
            # keep_vars=True asks for the parameters themselves, not their values
            if isinstance(t, Tensor) and not isinstance(t, nn.Parameter) and t.untyped_storage().data_ptr() in flats:
                key = (t.data_ptr(), t.dtype, tuple(t.shape))
                if key not in copies:
                    copies[key] = t.clone()
                state_dict[name] = copies[key]


ZERO3_GATHER_ENV = "PIPELINERL_ZERO3_GATHER"  # direct (default) | deepspeed: see WeightPublisher._zero3_units


def _partition_on_device(p: Tensor) -> bool:
    """A ZeRO-3 parameter whose partition this rank holds in plain form on its own device."""
    part = getattr(p, "ds_tensor", None)
    if part is None or hasattr(part, "ds_quant_scale") or getattr(p, "ds_process_group", None) is None:
        return False
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.partition_parameters import PartitionedParamStatus

    return getattr(part, "status", None) == PartitionedParamStatus.AVAILABLE and \
        part.device == torch.device(get_accelerator().current_device_name())


def _gather_partitions(p: Tensor) -> Tensor:
    """The full parameter from every rank's partition (see `WeightPublisher._zero3_units`): an all-gather into a
    new tensor, the current stream ordered after it (NCCL) or the host after it (gloo), no device-wide sync."""
    import torch.distributed as dist

    part = p.ds_tensor
    world = dist.get_world_size(p.ds_process_group)
    flat = torch.empty(part.numel() * world, dtype=part.dtype, device=part.device)
    dist.all_gather_into_tensor(flat, part.contiguous(), group=p.ds_process_group, async_op=True).wait()
    return flat.narrow(0, 0, p.ds_numel).view(p.ds_shape)


def _is_fsdp2(module: nn.Module) -> bool:
    """Whether the parameters are FSDP2 DTensors (each can be gathered alone) rather than FSDP1 flat ones."""
    with contextlib.suppress(StopIteration):
        return hasattr(next(module.parameters()), "full_tensor")
    return False
