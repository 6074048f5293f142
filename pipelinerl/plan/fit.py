"""The plan of a recipe on a cluster: where every process goes (`placement.plan_node` on every node, so the plan
is the launcher's own), what each GPU and each node's host memory must hold, and the problems and warnings.
`make_plan` adds, when the recipe does not fit, the changes that would make it fit (`suggestions`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipelinerl.config import RunConfig, resolve_for_machine
from pipelinerl.placement import NodeEnv, NodePlan, plan_node
from pipelinerl.plan.memory import MIN_SEQUENCES, EngineMemory, TrainerMemory, engine_memory, trainer_memory
from pipelinerl.plan.shapes import ModelShape, model_shape
from pipelinerl.plan.sharding import Sharding, detect_sharding
from pipelinerl.plan.units import GIB, _gib, _range


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu_memory_gib: float
    host_memory_gib: float = 0.0  # per node; 0: not known (not checked)
    host_memory_guessed: bool = False  # this machine's, which has no GPU: a warning, not a verdict

    @property
    def gpu_bytes(self) -> int:
        return int(self.gpu_memory_gib * GIB)

    def describe(self) -> str:
        if self.gpus_per_node == 0:
            return f"{self.nodes} node{'s' if self.nodes > 1 else ''}, CPU only"
        return (f"{self.nodes} node{'s' if self.nodes > 1 else ''} x {self.gpus_per_node} "
                f"GPU{'s' if self.gpus_per_node > 1 else ''} of "
                f"{self.gpu_memory_gib:g} GiB")


@dataclass(frozen=True)
class GpuUse:
    node: int
    gpu: int
    roles: tuple[str, ...]  # "trainer rank 0", "engine 3"; empty: idle
    need: int
    capacity: int


@dataclass(frozen=True)
class Suggestion:
    changes: dict[str, Any]  # config key (or flag) -> value
    text: str
    enough: bool  # makes the recipe fit on its own


@dataclass
class Plan:
    cluster: Cluster
    shape: ModelShape
    sharding: Sharding
    nodes: list[NodePlan]
    trainer_main: TrainerMemory
    trainer_other: TrainerMemory | None  # None with one trainer rank
    engine: EngineMemory | None  # None without engines
    gpus: list[GpuUse]
    colocated: bool
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    suggestions: list[Suggestion] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def host_per_node(self) -> list[int]:
        """Host memory each node needs (`host_memory`)."""
        return [host_memory(self, n) for n in self.nodes]

    @property
    def on_gpu(self) -> bool:
        return self.cluster.gpus_per_node > 0

    @property
    def trainer_fits(self) -> bool:
        return not any(p.startswith("trainer") for p in self.problems)


def place(cfg: RunConfig, cluster: Cluster) -> list[NodePlan]:
    """`plan_node` for every node. Nodes other than 0 reach node 0 at a placeholder non-loopback address, so a
    multi-node recipe whose engines bind a loopback address fails here as it would at launch."""
    master = "node0" if cluster.nodes > 1 else "127.0.0.1"
    return [plan_node(cfg, NodeEnv(cluster.nodes, rank, master), cluster.gpus_per_node)
            for rank in range(cluster.nodes)]


def make_plan(cfg: RunConfig, cluster: Cluster) -> Plan:
    """The whole plan: placement, memory per GPU, problems, warnings and (when it does not fit) suggestions.
    Raises ConfigError for a recipe that cannot be placed at all."""
    # `suggestions` plans variants of the recipe with `_plan`, so it imports this module: imported here instead
    from pipelinerl.plan.suggestions import suggestions

    cfg, _ = resolve_for_machine(cfg, cluster.gpus_per_node)  # "auto" dtype and backend, as the launcher would
    plan = _plan(cfg, cluster, model_shape(cfg), detect_sharding(cfg))
    if plan.on_gpu and not plan.fits:
        plan.suggestions = suggestions(cfg, plan)
    return plan


def _plan(cfg: RunConfig, cluster: Cluster, shape: ModelShape, sharding: Sharding) -> Plan:
    """The plan without suggestions, for a shape and sharding worked out once (the suggestions try shardings
    whose configs do not exist as files)."""
    nodes = place(cfg, cluster)
    on_gpu = cluster.gpus_per_node > 0
    colocated = on_gpu and cfg.engine.colocate_with_trainer
    main = trainer_memory(shape, cfg, sharding, main=True, on_gpu=on_gpu)
    other = trainer_memory(shape, cfg, sharding, main=False, on_gpu=on_gpu) if sharding.ranks > 1 else None
    has_engines = any(n.engines for n in nodes)
    engine = engine_memory(shape, cfg, cluster.gpu_bytes if on_gpu else 0) if has_engines else None
    gpus = _gpu_uses(nodes, cluster, main, other, engine)
    plan = Plan(cluster, shape, sharding, nodes, main, other, engine, gpus, colocated)
    if on_gpu:
        _check(plan)
    return plan


def _gpu_uses(nodes: list[NodePlan], cluster: Cluster, main: TrainerMemory, other: TrainerMemory | None,
              engine: EngineMemory | None) -> list[GpuUse]:
    uses = []
    for node_plan in nodes:
        rank = node_plan.node.rank
        for gpu in range(cluster.gpus_per_node):
            roles, need = [], 0
            if gpu in node_plan.trainer_gpus:
                r = node_plan.first_trainer_rank + node_plan.trainer_gpus.index(gpu)
                roles.append(f"trainer rank {r}")
                need += (main if r == 0 else other or main).total
            for slot in node_plan.engines:
                if gpu in slot.gpus and engine is not None:
                    roles.append(f"engine {slot.index}")
                    need += engine.budget
            uses.append(GpuUse(rank, gpu, tuple(roles), need, cluster.gpu_bytes))
    return uses


# Host memory of each process beside what the plan counts (Python, torch and CUDA's host side, vLLM's scheduler,
# DeepSpeed's buffers): a round figure, so that a node whose host memory is nearly full is still caught.
HOST_PROCESS_GIB = 6.0


def host_memory(plan: Plan, node: NodePlan) -> int:
    """Host memory node `node` needs: per trainer process its offloaded state and HOST_PROCESS_GIB, per engine
    worker HOST_PROCESS_GIB and, where updates are staged in host memory, the whole update."""
    per_process = int(HOST_PROCESS_GIB * GIB)
    need = 0
    for k in range(node.trainer_processes if node.runs_trainer else 0):
        rank = node.first_trainer_rank + k
        need += (plan.trainer_main if rank == 0 else plan.trainer_other or plan.trainer_main).host_bytes + per_process
    workers = sum(len(s.gpus) or 1 for s in node.engines)
    staging = plan.engine.host_staging if plan.engine is not None else 0
    return need + workers * (per_process + staging)


def _check(plan: Plan) -> None:
    """Problems (the recipe does not fit) and warnings, one per kind of GPU rather than one per GPU."""
    seen: set[tuple[tuple[str, ...], int]] = set()
    for use in plan.gpus:
        key = (_role_kind(use.roles), use.need)
        if use.need <= use.capacity or key in seen:
            continue
        seen.add(key)
        alike = [u for u in plan.gpus if (_role_kind(u.roles), u.need) == key]
        what = "trainer" if any(r.startswith("trainer") for r in use.roles) else "engine"
        nodes = sorted({u.node for u in alike})
        where = "; ".join(f"node {n} GPU{'s' if sum(u.node == n for u in alike) > 1 else ''} "
                          f"{_range([u.gpu for u in alike if u.node == n])}" for n in nodes)
        roles = _describe_roles(alike).removesuffix(" (main process: broadcasts weights)")
        text = (f"{what}: {where} ({roles}) need{'s' if len(alike) == 1 else ''} "
                f"{_gib(use.need)} GiB{' each' if len(alike) > 1 else ''}; a GPU has {_gib(use.capacity)} GiB")
        if plan.colocated and what == "trainer" and plan.engine is not None:
            text += f" (the engine's share, {_gib(plan.engine.budget)} GiB, included)"
        plan.problems.append(text)
    host = plan.cluster.host_memory_gib * GIB
    if host:
        short = [(n.node.rank, need) for n, need in zip(plan.nodes, plan.host_per_node) if need > host]
        if short:
            rank, need = max(short, key=lambda x: x[1])
            staged = plan.engine is not None and plan.engine.host_staging
            why = (f" ({_gib(plan.engine.host_staging)} GiB of it per engine worker: weight updates staged in host "
                   "memory by PIPELINERL_VLLM_STAGING=cpu; leave it unset to stream them instead)" if staged else "")
            text = (f"host: node{'s' if len(short) > 1 else ''} {_range([r for r, _ in short])} "
                    f"need{'s' if len(short) == 1 else ''} up to {_gib(need)} GiB of host memory, and a node has "
                    f"{_gib(host)} GiB{why}")
            if plan.cluster.host_memory_guessed:
                plan.warnings.append(f"{text}: this machine's memory, and it has no GPU, so it is probably not a node "
                                     "of this cluster; pass --host-memory with the nodes' memory to check")
            else:
                plan.problems.append(f"{text} (--host-memory)")
    e = plan.engine
    if e is None:
        return
    if e.sequences < 1:
        plan.problems.append(
            f"engine: the weights ({_gib(e.weights)} GiB) and overhead ({_gib(e.overhead)} GiB) leave "
            f"{_gib(max(0, e.kv_room))} GiB of the engine's {_gib(e.budget)} GiB ({e.note}) for KV cache: not one "
            f"sequence of engine.max_model_len {e.max_model_len} tokens "
            f"({_gib(e.kv_bytes_per_token * e.max_model_len)} GiB)")
    elif e.sequences < MIN_SEQUENCES:
        # fewer than max_running_seqs is normal with a long max_model_len (vLLM/SGLang queue the rest); this few
        # leaves the GPU idle between few decode steps
        plan.warnings.append(
            f"engine: KV cache for only {e.sequences} sequences of engine.max_model_len {e.max_model_len} tokens "
            f"({e.tokens:,} tokens); under {MIN_SEQUENCES} the engine decodes few sequences at a time and crawls")


def _role_kind(roles: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(r.rsplit(" ", 1)[0] for r in roles)


def _describe_roles(group: list[GpuUse]) -> str:
    if not group[0].roles:
        return "idle"
    parts = []
    for k in range(len(group[0].roles)):
        kind = group[0].roles[k].rsplit(" ", 1)[0]
        numbers = [int(u.roles[k].rsplit(" ", 1)[1]) for u in group]
        parts.append(f"{kind}{'s' if len(numbers) > 1 else ''} {_range(numbers)}")  # engines, trainer ranks
    text = " + ".join(parts)
    return text + (" (main process: broadcasts weights)" if "trainer rank 0" in group[0].roles else "")
