"""The plan printed: a text report (`format_plan`: the recipe, the placement, the memory tables, the run's host
memory, checkpoints and deadlines, the verdict and suggestions) or JSON (`plan_to_json`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from pipelinerl.config import RunConfig
from pipelinerl.placement import NodePlan
from pipelinerl.plan.fit import GpuUse, Plan, _describe_roles, _role_kind
from pipelinerl.plan.forecast import Forecast
from pipelinerl.plan.memory import (
    ENGINE_OVERHEAD_GIB,
    ENGINE_PREFILL_TOKENS,
    TRAINER_OVERHEAD_GIB,
    TrainerMemory,
    _precision,
    _takes_gpu_share,
)
from pipelinerl.plan.units import GIB, _gib, _range


def _count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(n)


def _placement_rows(plan: Plan, cfg: RunConfig) -> list[tuple[str, str, str, str]]:
    """(nodes, GPUs, what runs there, need) rows, consecutive alike GPUs and then alike nodes merged."""
    per_node: list[list[tuple[str, str, str]]] = []
    for node_plan in plan.nodes:
        rank = node_plan.node.rank
        rows: list[tuple[str, str, str]] = []
        uses = [u for u in plan.gpus if u.node == rank]
        groups: list[list[GpuUse]] = []
        for use in uses:
            last = groups[-1][-1] if groups else None
            if (last is not None and last.need == use.need and _role_kind(last.roles) == _role_kind(use.roles)
                    and "trainer rank 0" not in last.roles and "trainer rank 0" not in use.roles):
                groups[-1].append(use)
            else:
                groups.append([use])
        for group in groups:
            gpus = _range([u.gpu for u in group])
            rows.append((gpus, _describe_roles(group), _gib(group[0].need) if group[0].roles else "-"))
        if not plan.on_gpu:
            if node_plan.runs_trainer:
                ranks = node_plan.trainer_processes
                rows.append(("CPU", "trainer" + (f" ({ranks} processes)" if ranks > 1 else ""), ""))
            if node_plan.engines:
                rows.append(("CPU", _describe_roles([GpuUse(rank, 0, (f"engine {s.index}",), 0, 0)
                                                     for s in node_plan.engines]), ""))
        if node_plan.main:
            rows.append(("CPU", f"actor, reward pool ({cfg.reward.workers} worker"
                                f"{'s' if cfg.reward.workers > 1 else ''})", "-" if plan.on_gpu else ""))
        per_node.append(rows)
    merged: list[tuple[str, str, str, str]] = []
    i = 0
    while i < len(per_node):
        j = i
        while j + 1 < len(per_node) and per_node[j + 1] == per_node[i]:
            j += 1
        label = _range([plan.nodes[k].node.rank for k in range(i, j + 1)])
        for gpus, what, need in per_node[i]:
            merged.append((label, gpus, what + (" (each node)" if j > i else ""), need))
        i = j + 1
    return merged


def format_plan(plan: Plan, cfg: RunConfig, recipe: str = "") -> str:
    s, t, e = plan.shape, cfg.trainer, cfg.engine
    out: list[str] = []
    out.append(f"pipelinerl plan {recipe}: {plan.cluster.describe()}".replace("plan :", "plan:"))
    out.append(f"model    {s.name} ({s.source}): {_count(s.num_params)} parameters; hidden {s.hidden_size}, "
               f"{s.num_layers} layers, {s.num_heads} heads ({s.num_kv_heads} KV, head_dim {s.head_dim}), "
               f"intermediate {s.intermediate_size}, vocab {s.vocab_size}, "
               f"{'tied' if s.tie_word_embeddings else 'untied'} embeddings")
    precision = _precision(cfg, plan.on_gpu)
    over = f" over {t.num_nodes} nodes ({t.num_processes // t.num_nodes} each)" if t.num_nodes > 1 else ""
    out.append(f"trainer  {t.num_processes} process{'es' if t.num_processes > 1 else ''}{over}, "
               f"{plan.sharding.describe()}; "
               f"mixed precision {precision}, gradient checkpointing "
               f"{'on' if plan.trainer_main.checkpointing else 'off'}, micro-batch {t.micro_batch_tokens} tokens, "
               f"{t.attn_implementation} attention")
    engines = sum(len(n.engines) for n in plan.nodes)
    tp = f", tensor parallel {e.tensor_parallel_size} ({e.tensor_parallel_size} GPUs each)" \
        if e.tensor_parallel_size > 1 else ""
    out.append(f"engines  {engines} x {e.kind}{tp}, {cfg.model.dtype} weights, max_model_len {e.max_model_len}, "
               f"max_running_seqs {e.max_running_seqs}"
               + (f", gpu_memory_utilization {e.gpu_memory_utilization:g}" if plan.on_gpu else "")
               + (", sharing the trainer's GPUs" if plan.colocated else ""))
    out.append("")
    rows = _placement_rows(plan, cfg)
    head = ("node", "GPU" if plan.on_gpu else "on", "runs", "GiB needed" if plan.on_gpu else "")
    widths = [max(len(r[k]) for r in [head, *rows]) for k in range(4)]
    out.append("placement")
    for r in [head, *rows]:
        out.append(("  " + "  ".join(r[k].ljust(widths[k]) if k < 3 else r[k].rjust(widths[k])
                                     for k in range(4))).rstrip())
    out.append("")
    where = "" if plan.on_gpu else " (host RAM: a CPU recipe)"
    out.extend(_trainer_table(plan, where))
    if plan.engine is not None:
        out.append("")
        out.extend(_engine_table(plan, where))
    out.append("")
    out.extend(_run_lines(plan, cfg))
    out.append("")
    if not plan.on_gpu:
        out.append("verdict: a CPU recipe: nothing to place on GPUs; the figures above are host RAM estimates")
        return "\n".join(out)
    for w in plan.warnings:
        out.append(f"warning: {w}")
    if plan.fits:
        trainer = max(u.need for u in plan.gpus if any(r.startswith("trainer") for r in u.roles))
        text = f"verdict: fits: a trainer GPU needs {_gib(trainer)} of {_gib(plan.cluster.gpu_bytes)} GiB"
        if plan.colocated:
            text += " (with the engine's share)"
        if plan.engine is not None and _takes_gpu_share(plan.engine.kind):
            text += (f"; each engine has KV room for {plan.engine.sequences} sequences of "
                     f"{plan.engine.max_model_len} tokens")
        out.append(text)
    else:
        out.append("verdict: does NOT fit")
        for p in plan.problems:
            out.append(f"  - {p}")
        if plan.suggestions:
            out.append("to make it fit:")
            for sug in plan.suggestions:
                out.append(f"  - {sug.text}")
    return "\n".join(out)


def _checkpoint(plan: Plan, cfg: RunConfig):
    from pipelinerl.sizing import checkpoint_size

    return checkpoint_size(cfg, plan.shape.num_params, plan.sharding.deepspeed, _precision(cfg, plan.on_gpu) == "bf16")


def _start_timeout(plan: Plan, cfg: RunConfig) -> float:
    from pipelinerl.sizing import engine_start_timeout_s

    return engine_start_timeout_s(cfg, plan.shape.num_params)


def _run_lines(plan: Plan, cfg: RunConfig) -> list[str]:
    """Host memory per node, the checkpoints and the disk they take, the engines' start deadline."""
    from pipelinerl.sizing import checkpoints_on_disk, disk_size

    out = ["run"]
    if plan.on_gpu:
        host = plan.cluster.host_memory_gib
        needs = plan.host_per_node
        of = f" of {_gib(host * GIB)} GiB (--host-memory)" if host else ""
        per_node = ", ".join(f"node {n.node.rank} {_gib(x)} GiB" for n, x in zip(plan.nodes, needs))
        out.append(f"  host memory per node: {per_node}{of}")
    size = _checkpoint(plan, cfg)
    held = checkpoints_on_disk(cfg)
    out.append(f"  checkpoint: {size.describe()}; up to {held} at once in run_dir (trainer.keep_checkpoints "
               f"{cfg.trainer.keep_checkpoints} and the one being written): {disk_size(held * size.total)}; the "
               "launcher refuses a run_dir whose filesystem cannot hold two")
    timeout = _start_timeout(plan, cfg)
    how = "engine.start_timeout_s" if cfg.engine.start_timeout_s is not None else \
        "sized from the weights: engine.start_timeout_s to change it"
    out.append(f"  engines must answer within {timeout:g} s of their start ({how})")
    return out


def _trainer_table(plan: Plan, where: str) -> list[str]:
    main, other = plan.trainer_main, plan.trainer_other
    ranks = plan.sharding.ranks
    cols = ["rank 0"] + ([f"ranks 1-{ranks - 1}" if ranks > 2 else "rank 1"] if other else [])
    whole = [main, other] if other else [main]
    rows: list[tuple[str, str, list[str]]] = []

    def lines_of(kind: str, indent: str) -> None:
        """A row per line of `kind` in any column ("-" where a rank has none; rank 0's note)."""
        for name in dict.fromkeys(x.what for m in whole for x in getattr(m, kind)):
            lines = [next((x for x in getattr(m, kind) if x.what == name), None) for m in whole]
            note = next(x.note for x in lines if x is not None)
            rows.append((indent + name, note, [_gib(x.bytes) if x else "-" for x in lines]))

    lines_of("state", "")
    rows.append(("working set", "the larger of training and broadcast",
                 [_gib(max(m.training_bytes, m.broadcast_bytes)) for m in whole]))
    rows.append(("  training", "one micro-batch, forward and backward", [_gib(m.training_bytes) for m in whole]))
    lines_of("training", "    ")
    rows.append(("  broadcast", "weights to the engines, after the step", [_gib(m.broadcast_bytes) for m in whole]))
    lines_of("broadcast", "    ")
    if main.overhead:
        rows.append(("allowance", f"CUDA context, NCCL, fragmentation ({TRAINER_OVERHEAD_GIB:g} GiB)",
                     [_gib(m.overhead) for m in whole]))
    rows.append(("total", "", [_gib(m.total) for m in whole]))
    title = f"trainer memory{where}, GiB per {'GPU' if plan.on_gpu else 'process'}"
    lines = _table(title, cols, rows)
    if main.host_bytes:
        lines.append(f"  host RAM for offloaded state: {_gib(main.host_bytes)} GiB per rank, "
                     f"{_gib(main.host_bytes * plan.nodes[0].trainer_processes)} GiB on each trainer node ("
                     + ", ".join(f"{x.what} {_gib(x.bytes)}" for x in main.host) + " per rank)")
    return lines


def _engine_table(plan: Plan, where: str) -> list[str]:
    e = plan.engine
    assert e is not None
    tp = e.tensor_parallel
    wb = round(e.weights * tp / plan.shape.num_params)
    whole = "the whole model on each engine" if tp == 1 else f"/ {tp}: this GPU's shard of its engine's model"
    rows = [("budget", e.note, [_gib(e.budget)]), ("weights", f"{wb} B/param, {whole}", [_gib(e.weights)])]
    if e.overhead:
        rows.append(("overhead", f"{ENGINE_OVERHEAD_GIB:g} GiB context/graphs + {ENGINE_PREFILL_TOKENS}-token prefill "
                                 "+ sampler logits", [_gib(e.overhead)]))
    rows.append(("KV cache", f"{e.kv_bytes_per_token:,} B/token: {e.tokens:,} tokens = {e.sequences} sequences of "
                             f"{e.max_model_len}", [_gib(max(0, e.kv_room))]))
    per = "engine" if tp == 1 else f"engine GPU ({tp} per engine)"
    lines = _table(f"engine memory{where}, GiB per {per}", [""], rows)
    if e.staging:
        fits = max(0.0, 1 - e.staging / e.gpu_bytes) if e.gpu_bytes else 0.0
        if e.staging_on_gpu:
            lines.append(f"  weight updates staged on each engine GPU: {_gib(e.staging)} GiB beside the budget")
        elif e.streamed:
            lines.append(f"  weight updates streamed into the weights while generation pauses (staging one takes "
                         f"{_gib(e.staging)} GiB beside the budget, which a GPU does not have): no staging memory; "
                         f"engine.gpu_memory_utilization <= {fits:.2f} would stage them on the GPU and pause only "
                         "for the switch")
        elif e.colocated:
            lines.append(f"  weight updates staged in host memory unless the trainer leaves {_gib(e.staging)} GiB "
                         "free on the shared GPU (checked at each update)")
        else:
            lines.append(f"  weight updates staged in page-locked host memory (PIPELINERL_VLLM_STAGING="
                         f"{e.staging_choice}): {_gib(e.staging)} GiB per engine GPU (the whole update on every "
                         "worker)")
    return lines


def _table(title: str, cols: list[str], rows: list[tuple[str, str, list[str]]]) -> list[str]:
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    wc = [max(len(c), *(len(r[2][k]) for r in rows if k < len(r[2]))) for k, c in enumerate(cols)]
    lines = [title]
    if any(cols):
        lines.append("  " + " " * (w0 + w1 + 2) + "  " + "  ".join(c.rjust(wc[k]) for k, c in enumerate(cols)))
    for label, note, values in rows:
        lines.append("  " + label.ljust(w0) + "  " + note.ljust(w1) + "  "
                     + "  ".join(v.rjust(wc[k]) for k, v in enumerate(values)))
    return lines


def plan_to_json(plan: Plan, cfg: RunConfig) -> dict[str, Any]:
    def memory(m: TrainerMemory | None) -> dict[str, Any] | None:
        if m is None:
            return None
        return {**{kind: [dataclasses.asdict(x) for x in getattr(m, kind)]
                   for kind in ("state", "training", "broadcast", "host")},
                "overhead": m.overhead, "checkpointing": m.checkpointing, "training_bytes": m.training_bytes,
                "broadcast_bytes": m.broadcast_bytes, "total_bytes": m.total, "host_bytes": m.host_bytes}

    def cpu(n: NodePlan) -> list[str]:
        """What runs on a node's CPUs: node 0's actor and reward pool, and on a CPU recipe everything."""
        roles = ["actor", f"reward pool ({cfg.reward.workers})"] if n.main else []
        if not plan.on_gpu:
            roles += (["trainer"] if n.runs_trainer else []) + [f"engine {s.index}" for s in n.engines]
        return roles

    e = plan.engine
    return {
        "fits": plan.fits,
        "cluster": dataclasses.asdict(plan.cluster),
        "model": {**dataclasses.asdict(plan.shape), "num_params": plan.shape.num_params},
        "sharding": {**dataclasses.asdict(plan.sharding), "description": plan.sharding.describe()},
        "placement": [{"node": n.node.rank, "trainer_gpus": list(n.trainer_gpus),
                       "trainer_first_rank": n.first_trainer_rank if n.runs_trainer else None,
                       "engines": [{"index": s.index, "gpus": list(s.gpus)} for s in n.engines],
                       "cpu": cpu(n)} for n in plan.nodes],
        "gpus": [{"node": u.node, "gpu": u.gpu, "roles": list(u.roles), "need_bytes": u.need,
                  "capacity_bytes": u.capacity} for u in plan.gpus],
        "trainer": {"rank0": memory(plan.trainer_main), "other_ranks": memory(plan.trainer_other)},
        "engine": None if e is None else {
            "kind": e.kind, "tensor_parallel_size": e.tensor_parallel, "budget_bytes": e.budget,
            "weights_bytes": e.weights, "overhead_bytes": e.overhead,
            "kv_room_bytes": e.kv_room, "kv_bytes_per_token": e.kv_bytes_per_token, "tokens": e.tokens,
            "sequences": e.sequences, "max_model_len": e.max_model_len, "update_staging_bytes": e.staging,
            "update_staging_on_gpu": e.staging_on_gpu, "updates_streamed": e.streamed,
            "update_host_staging_bytes": e.host_staging},
        "host_bytes_per_node": plan.host_per_node,
        "host_memory_bytes": int(plan.cluster.host_memory_gib * GIB),
        "checkpoint_bytes": _checkpoint(plan, cfg).total,
        "engine_start_timeout_s": _start_timeout(plan, cfg),
        "problems": plan.problems,
        "warnings": plan.warnings,
        "suggestions": [dataclasses.asdict(x) for x in plan.suggestions],
    }


def _duration(seconds: float) -> str:
    """Seconds in the unit that reads best: 850 ms, 41.2 s, 12.5 min, 9.3 h, 4.2 days."""
    for scale, unit in ((86400, "days"), (3600, "h"), (60, "min")):
        if seconds >= 2 * scale:
            return f"{seconds / scale:.1f} {unit}"
    return f"{seconds:.1f} s" if seconds >= 1 else f"{seconds * 1e3:.0f} ms"


def _flops(x: float) -> str:
    for scale, unit in ((1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP")):
        if x >= scale:
            return f"{x / scale:,.1f} {unit}"
    return f"{x:,.0f} FLOP"


def _seconds(x: float) -> str:
    if x >= 1:
        return f"{x:,.1f}"
    return f"{x:.3f}" if x >= 0.001 else f"{x:.1e}"


def _bytes(x: float) -> str:
    """Decimal units, as the vendors' bandwidths are."""
    return f"{x / 1e9:.1f} GB" if x >= 1e9 else f"{x / 1e6:.1f} MB"


def _plural(n: int, what: str) -> str:
    return f"{n:,} {what}{'' if n == 1 else 's'}"


def format_forecast(f: Forecast) -> str:
    """The forecast of one RL step and of the run, as text (`pipelinerl plan --time`)."""
    a, acc = f.assumptions, f.accelerator
    unit = acc.unit
    out = [f"forecast (--time): {acc.name}; {acc.source}",
           f"  assumed: answers of {a.mean_answer_tokens:,} tokens on average ({a.answer_source}; "
           f"--mean-answer-tokens), prompts of {a.mean_prompt_tokens:,} ({a.prompt_source}; --mean-prompt-tokens)",
           f"  assumed: MFU {a.mfu:g} (--mfu), decode at {a.mbu:g} of the memory bandwidth (--mbu), links at "
           f"{a.link_efficiency:g} of their peak. Assumptions, not measurements: the answer length above all, which "
           "grows during a reasoning run"]
    out.append(f"  engines: {f.engines} x {_plural(f.devices_per_engine, unit)}, {f.running_per_engine} sequences "
               f"decoding at once each (bound: "
               f"{f.running_bound}); a decode step {f.decode_step_s * 1e3:.1f} ms, "
               f"{'memory' if f.decode_memory_bound else 'compute'}-bound ({_bytes(f.decode_step_bytes)} read "
               f"per step per engine)")
    if f.pipelined:
        how = "pipelined (actor.max_lag > 0): max(generate, train) + broadcast"
    elif f.colocated:
        how = "engines on the trainer's GPUs, taking turns: generate + train + broadcast"
    else:
        how = "synchronous (actor.max_lag 0): generate + train + broadcast"
    rows: list[tuple[str, str, list[str]]] = [
        ("  generate", f"{f.samples_per_step} samples on {_plural(f.engines, 'engine')}", [_seconds(f.generate_s)]),
        ("    prefill", "2N FLOPs per prompt token", [_seconds(f.prefill_s)]),
        ("    decode", "weights + KV cache read per decode step", [_seconds(f.decode_s)]),
        ("  train", f"{_flops(f.train_flops)} on {_plural(f.trainer_devices, unit)}", [_seconds(f.train_s)])]
    total = f.train_flops or 1.0
    for what, note, flops in f.train_parts:
        rows.append((f"    {what}", f"{flops / total:.0%}: {note}", [_seconds(f.train_s * flops / total)]))
    rows.append(("  broadcast", f"{_bytes(f.update_bytes)} over {f.link}", [_seconds(f.broadcast_s)]))
    if f.gather_s:
        rows.append(("    gather", "ZeRO-3/FSDP all-gather, pipelined with the send", [_seconds(f.gather_s)]))
        rows.append(("    send", "to every engine GPU", [_seconds(f.send_s)]))
    rows.append(("  step", how, [_seconds(f.step_s)]))
    out.extend(_table("  one RL step, seconds", [""], rows))
    out.append(f"  throughput: {f.samples_per_s:,.1f} samples/s, {f.generated_tokens_per_s:,.0f} generated tokens/s; "
               f"{f.bottleneck} is the longer side (the engines busy {min(1.0, f.generate_s / f.step_s):.0%} of a "
               f"step, the trainer {min(1.0, f.train_s / f.step_s):.0%})")
    cost = f", ${f.cost_usd:,.0f} at ${a.usd_per_device_hour:g} per {unit}-hour" if f.cost_usd is not None else \
        " (--usd-per-gpu-hour for its cost)"
    out.append(f"  run: {f.steps} steps (trainer.max_steps): {_duration(f.run_s)} wall-clock, "
               f"{f.device_hours:,.1f} {unit}-hours ({_plural(f.devices, unit)} held){cost}")
    for note in f.notes:
        out.append(f"  note: {note}")
    out.append("  not counted: evaluations (trainer.eval_every), checkpoints, the engines' start, tensor-parallel "
               "all-reduces, scheduling overhead, regenerated groups (dynamic sampling), skipped samples "
               "(trainer.skip_zero_advantage)")
    return "\n".join(out)
