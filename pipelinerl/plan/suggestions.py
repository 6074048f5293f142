"""What to change when a recipe does not fit, each change tried by planning the recipe again on the same
cluster: trainer changes (checkpointing, a smaller micro-batch, more sharded ranks, CPU offload) alone and
together, the engines' share of the GPU, tensor parallelism, and the GPU memory that fits the recipe as it is."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelinerl.config import ConfigError, RunConfig
from pipelinerl.plan.fit import Plan, Suggestion, _plan
from pipelinerl.plan.memory import MIN_SEQUENCES, _takes_gpu_share
from pipelinerl.plan.sharding import Sharding
from pipelinerl.plan.units import GIB, _gib


def _variant(cfg: RunConfig, **sections: dict[str, Any]) -> RunConfig:
    """`cfg` with some keys changed, validated like a loaded config (raises ConfigError)."""
    changed = {name: dataclasses.replace(getattr(cfg, name), **keys) for name, keys in sections.items()}
    return dataclasses.replace(cfg, **changed)


def _try(base: Plan, cfg: RunConfig, sharding: Sharding, **sections: dict[str, Any]) -> Plan | None:
    """`base`'s recipe with some keys changed (see _variant) and `sharding`, planned on the same cluster and model;
    None if the change is not a valid config or cannot be placed."""
    try:
        return _plan(_variant(cfg, **sections), base.cluster, base.shape, sharding)
    except ConfigError:
        return None


@dataclass(frozen=True)
class _Option:
    """One change to the trainer: config sections to replace and the sharding it implies."""

    tag: str  # checkpointing | micro_batch | ranks | offload_optimizer | offload_params
    changes: dict[str, Any]
    text: str
    sections: dict[str, dict[str, Any]]
    sharding: Sharding


OFFLOAD_TEXT = ("DeepSpeed ZeRO-3 with {what} offloaded to CPU (trainer.accelerate_config: an accelerate YAML "
                "naming a copy of configs/deepspeed/zero3.json with {keys} and zero_force_ds_cpu_optimizer=false, as "
                "the trainer builds torch AdamW)")


def suggestions(cfg: RunConfig, plan: Plan) -> list[Suggestion]:
    """Changes that make the recipe fit, each tried by planning again: single trainer changes (with what each
    saves), all of them together in order when none is enough alone, the engine's share when engines share the
    trainer's GPUs, engine changes when an engine has no KV room, and the GPU memory that fits it as it is."""
    out: list[Suggestion] = []
    cluster, e = plan.cluster, cfg.engine
    util = e.gpu_memory_utilization
    if not plan.trainer_fits:
        options = _trainer_options(cfg, plan)
        for option in options:
            tried = _try(plan, cfg, option.sharding, **option.sections)
            if tried is None or tried.trainer_main.total >= plan.trainer_main.total:
                continue
            saved = plan.trainer_main.total - tried.trainer_main.total
            out.append(Suggestion(option.changes, f"{option.text}: {_gib(tried.trainer_main.total)} GiB on trainer "
                                                  f"rank 0 (saves {_gib(saved)} GiB)"
                                                  + ("" if tried.trainer_fits else ", not enough alone"),
                                  tried.fits))
        if options and not any(s.enough for s in out):
            combined = _combined(cfg, plan, options)
            if combined is not None:
                out.append(combined)
        if plan.colocated and plan.engine is not None:
            lower = math.floor((cluster.gpu_bytes - plan.trainer_main.total) / cluster.gpu_bytes * 100) / 100
            if 0 < lower < util:
                tried = _try(plan, cfg, plan.sharding, engine={"gpu_memory_utilization": lower})
                if tried is not None and tried.engine is not None and tried.engine.sequences >= 1:
                    out.append(Suggestion({"engine.gpu_memory_utilization": lower},
                                          f"engine.gpu_memory_utilization={lower:g}: the engine leaves the trainer "
                                          f"{_gib(cluster.gpu_bytes - tried.engine.budget)} GiB and holds "
                                          f"{tried.engine.sequences} sequences", tried.fits))
    eng = plan.engine
    if eng is not None and eng.sequences < 1 and _takes_gpu_share(e.kind):
        if util < 0.95 and not plan.colocated:
            tried = _try(plan, cfg, plan.sharding, engine={"gpu_memory_utilization": 0.95})
            if tried is not None and tried.engine is not None and tried.engine.sequences >= 1:
                out.append(Suggestion({"engine.gpu_memory_utilization": 0.95},
                                      f"engine.gpu_memory_utilization=0.95: KV room for {tried.engine.sequences} "
                                      "sequences", tried.fits))
        tp = e.tensor_parallel_size * 2
        while not plan.colocated and tp <= cluster.gpus_per_node:  # split each engine over more GPUs
            tried = _try(plan, cfg, plan.sharding, engine={"tensor_parallel_size": tp})
            if tried is not None and tried.engine is not None and tried.engine.sequences >= 1:
                engines = sum(len(n.engines) for n in tried.nodes)
                out.append(Suggestion({"engine.tensor_parallel_size": tp},
                                      f"engine.tensor_parallel_size={tp}: {engines} engines of {tp} GPUs, each with "
                                      f"KV room for {tried.engine.sequences} sequences", tried.fits))
                break
            tp *= 2
        if eng.tokens > cfg.sampling.max_new_tokens + 1:
            out.append(Suggestion({"engine.max_model_len": eng.tokens},
                                  f"engine.max_model_len={eng.tokens} (and sampling.max_new_tokens below it): the "
                                  "KV room holds one sequence that long, no more", False))
    need_gib = minimum_gpu_memory(cfg, plan)
    if need_gib is not None and need_gib > cluster.gpu_memory_gib:
        out.append(Suggestion({"resources.gpu_memory_gib": need_gib},
                              f"GPUs of at least {need_gib} GiB (--gpu-memory {need_gib}, "
                              f"resources.gpu_memory_gib={need_gib})", True))
    return out


def _trainer_options(cfg: RunConfig, plan: Plan) -> list[_Option]:
    """Single changes that shrink a trainer GPU's memory, in the order they are combined: the cheapest first."""
    t, e = cfg.trainer, cfg.engine
    cluster, sharding = plan.cluster, plan.sharding
    options: list[_Option] = []

    def add(option: _Option) -> None:
        try:
            _variant(cfg, **option.sections)
        except ConfigError:
            return
        options.append(option)

    if not plan.trainer_main.checkpointing:
        add(_Option("checkpointing", {"trainer.gradient_checkpointing": True}, "trainer.gradient_checkpointing=true",
                    {"trainer": {"gradient_checkpointing": True}}, sharding))
    # the largest smaller micro-batch that fits, but at least engine.max_model_len (one whole sample)
    sizes = _micro_batch_sizes(t.micro_batch_tokens, e.max_model_len)
    for size in sizes:
        tried = _try(plan, cfg, sharding, trainer={"micro_batch_tokens": size})
        if tried is not None and tried.trainer_fits:
            break
    if sizes:
        add(_Option("micro_batch", {"trainer.micro_batch_tokens": size}, f"trainer.micro_batch_tokens={size}",
                    {"trainer": {"micro_batch_tokens": size}}, sharding))
    # more trainer GPUs, sharded: the fewest that fit (or all the trainer nodes can give), the same on each
    most = cluster.gpus_per_node * t.num_nodes - (0 if cluster.nodes > t.num_nodes or plan.colocated else 1)
    zero3 = "configs/accelerate/deepspeed_zero3.yaml"
    for ranks in range(t.num_processes + 1, most + 1):
        if ranks % t.num_nodes:
            continue
        trainer: dict[str, Any] = {"num_processes": ranks}
        new_sharding = dataclasses.replace(sharding, ranks=ranks)
        if not sharding.divides[0] and Path(zero3).is_file():  # replicated parameters: shard them
            trainer["accelerate_config"] = zero3
            new_sharding = Sharding("zero3", ranks, sharding.offload_optimizer, sharding.offload_params, source=zero3)
        sections: dict[str, dict[str, Any]] = {"trainer": trainer}
        left = (cluster.gpus_per_node - ranks // t.num_nodes) // e.tensor_parallel_size
        if e.num_engines and cluster.nodes == 1 and not plan.colocated and e.num_engines > left:
            sections["engine"] = {"num_engines": left}
        tried = _try(plan, cfg, new_sharding, **sections)
        if tried is not None and (tried.trainer_fits or ranks == most):
            changes = {f"{name}.{k}": v for name, keys in sections.items() for k, v in keys.items()}
            text = ", ".join(f"{k}={v}" for k, v in changes.items())
            add(_Option("ranks", changes, f"{text} (fewer GPUs left for engines)", sections, new_sharding))
            break
    if not sharding.offload_optimizer:
        add(_Option("offload_optimizer", {"trainer.accelerate_config": "ZeRO-3 + offload_optimizer"},
                    OFFLOAD_TEXT.format(what="the optimizer",
                                        keys="zero_optimization.offload_optimizer.device=cpu"), {},
                    Sharding("zero3", t.num_processes, True, False, source="offload")))
    if not sharding.offload_params:
        add(_Option("offload_params", {"trainer.accelerate_config": "ZeRO-3 + offload_optimizer + offload_param"},
                    OFFLOAD_TEXT.format(what="optimizer and parameters",
                                        keys="offload_optimizer.device=cpu and offload_param.device=cpu"), {},
                    Sharding("zero3", t.num_processes, True, True, source="offload")))
    return options


def _micro_batch_sizes(current: int, floor: int) -> list[int]:
    """Smaller micro-batch sizes to try, largest first: halvings of the current one, then `floor`."""
    sizes, size = [], current
    while size // 2 >= floor:
        size //= 2
        sizes.append(size)
    if floor < current and floor not in sizes:
        sizes.append(floor)
    return sizes


def _combined(cfg: RunConfig, plan: Plan, options: list[_Option]) -> Suggestion | None:
    """The trainer changes applied one after another until the trainer fits; None if even all do not."""
    changes: dict[str, Any] = {}
    texts: dict[str, str] = {}
    sections: dict[str, dict[str, Any]] = {}
    sharding = plan.sharding
    tried: Plan | None = None
    for option in options:
        for name, keys in option.sections.items():
            sections.setdefault(name, {}).update(keys)
        if option.tag == "ranks":
            sharding = dataclasses.replace(option.sharding, offload_optimizer=sharding.offload_optimizer,
                                           offload_params=sharding.offload_params)
        elif option.tag.startswith("offload"):
            sharding = Sharding("zero3", sharding.ranks, True, option.sharding.offload_params, source="offload")
            texts.pop("offload_optimizer", None)  # the parameters' offload includes the optimizer's
        changes.update(option.changes)
        texts[option.tag] = option.text.split(" (fewer")[0]
        tried = _try(plan, cfg, sharding, **sections)
        if tried is not None and tried.trainer_fits:
            return Suggestion(dict(changes), "all together: " + "; ".join(texts.values())
                              + f": {_gib(tried.trainer_main.total)} GiB on trainer rank 0", tried.fits)
    if tried is None:
        return None
    return Suggestion(dict(changes), f"even all of the above together: {_gib(tried.trainer_main.total)} GiB on "
                                     "trainer rank 0, not enough", False)


def minimum_gpu_memory(cfg: RunConfig, plan: Plan) -> int | None:
    """Whole GiB per GPU that fits the recipe as it is, with room for MIN_SEQUENCES sequences per engine."""
    if not plan.on_gpu:
        return None
    trainer = max(plan.trainer_main.total, plan.trainer_other.total if plan.trainer_other else 0)
    need = float(trainer)
    e = plan.engine
    if e is not None and _takes_gpu_share(e.kind):
        util = cfg.engine.gpu_memory_utilization
        engine_need = (e.weights + e.overhead + MIN_SEQUENCES * e.max_model_len * e.kv_bytes_per_token) / util
        if plan.colocated:
            need = max(trainer / (1 - util) if util < 1 else math.inf, engine_need)
        else:
            need = max(need, engine_need)
    elif e is not None:
        need = max(need, float(e.budget + (trainer if plan.colocated else 0)))
    return math.ceil(need / GIB) if math.isfinite(need) else None
