"""Weight-sync throughput through the trainer's path, as a fraction of a raw broadcast of the same bytes.

Trainer path: `Trainer.broadcast_weights` -> POST /v1/weights/update to a real embedded engine process while
rank 0 broadcasts the parameters over gloo -> the engine receives them (`receive_tensors`) and switches its
weights -> the HTTP call returns. Everything the pipeline pays for, timed from the call to its return.

Raw: the same processes and the same gloo group, one broadcast per bucket of the same sizes, from
preallocated flat uint8 tensors into preallocated buffers, with as many broadcasts in flight as the trainer
path keeps (`PIPELINE_DEPTH`), timed on the sender after a barrier: no HTTP, no packing or unpacking, no
switch. The engine process serves one extra route for this (`/bench/raw_receive`), added by this file; an
engine that receives in a process of its own (on CPU, by default) has that process do the raw receiving.

Rounds alternate between the two (which goes first alternates too) so drift hits both. Per mode: `ratio` =
median trainer bytes/s / median raw bytes/s; `paired` = the per-round ratios (raw seconds / trainer seconds
of adjacent runs) as median, quartiles and range, the spread to quote. The headline `ratio` is the main model
(~90 MB) with 16 MB buckets (recipes/tiny_cpu.yaml's setting); its sweep adds 64 MB, 4 MB (the
WeightSyncConfig default) and per-tensor (bucket_mb = 0); a smaller and a larger model run at 16 MB. Each
mode also reports the engine's own receive and switch times and the trainer's `broadcast_tensors` time
(`trainer_send`: posting the requests and sending), so the gap can be attributed: `other` is what the trainer
path spends outside the engine's receive and switch (HTTP both ways, building the request, thread wake-ups).
The first two rounds of each mode are warm-up, not counted: the first bucketed broadcast lays the trainer's
parameters out for that bucket size and the engine allocates its arenas (once per run in a real run).
`--quick` uses an ~8 MB model, where fixed per-update costs dominate: a smoke run, not a measurement.

    python bench/trainer_weight_sync.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: make `pipelinerl` importable
    sys.path.insert(0, str(REPO))

import pipelinerl.engines.client as engine_client  # noqa: E402
from bench.common import machine  # noqa: E402
from pipelinerl.config import TrainerConfig, WeightSyncConfig  # noqa: E402
from pipelinerl.engines.client import EngineClient  # noqa: E402
from pipelinerl.procs import free_port, start_process, stop_process, tail  # noqa: E402
from pipelinerl.weight_sync import (  # noqa: E402
    ALIGN,
    PIPELINE_DEPTH,
    TensorSpec,
    WeightUpdateGroup,
    plan_buckets,
)

NAME = "trainer_weight_sync"
TARGET = 0.9
MAIN_BUCKET_MB = 16.0  # the measured `ratio`; the sweep adds 64, the config default (4) and per-tensor
SWEEP_BUCKET_MB = [64.0, 4.0, 0.0]
# (name, hidden size, layers): Qwen2 shapes, intermediate 4 x hidden; float32 sizes ~24, ~90, ~360 MB.
MODELS = [("h512x6", 512, 6), ("h256x6", 256, 6), ("h1024x6", 1024, 6)]
QUICK_MODELS = [("h256x2", 256, 2)]


def run(quick: bool = False) -> dict:
    """Measure both paths between one trainer and one engine process per model size; returns a JSON-able
    result."""
    models = QUICK_MODELS if quick else MODELS
    settings = {"models": {name: {"hidden_size": h, "num_layers": n} for name, h, n in models},
                "main_model": models[0][0], "bucket_mb": MAIN_BUCKET_MB,
                "sweep_bucket_mb": [0.0] if quick else SWEEP_BUCKET_MB, "rounds": 3 if quick else 61,
                "raw_in_flight": PIPELINE_DEPTH, "backend": "gloo", "threads_per_process": 1,
                "statistic": "median over interleaved rounds; paired = per-round raw/trainer seconds"}
    results = {}
    for i, (name, hidden, layers) in enumerate(models):
        sweep = [MAIN_BUCKET_MB, *settings["sweep_bucket_mb"]] if i == 0 else [MAIN_BUCKET_MB]
        results[name] = _measure_model(hidden, layers, sweep, settings["rounds"])
    modes = results[models[0][0]]
    main = modes[_mode_name(MAIN_BUCKET_MB)]
    ratio = main["ratio"]
    others = [f"{k} {v['ratio']:.2f}" for k, v in modes.items() if v is not main]
    at_main = {name: r[_mode_name(MAIN_BUCKET_MB)] for name, r in results.items() if r is not modes}
    others += [f"{name} ({m['model_mb']:.0f} MB) {m['ratio']:.2f}" for name, m in at_main.items()]
    summary = (f"{main['trainer_MBps']:.0f} vs raw {main['raw_MBps']:.0f} MB/s, {main['model_mb']:.0f} MB model, "
               f"{MAIN_BUCKET_MB:g} MB buckets, paired {main['paired']['p25']:.2f}-{main['paired']['p75']:.2f}; "
               + ", ".join(others))
    return {"name": NAME, "ratio": round(ratio, 4), "target": TARGET, "passed": ratio >= TARGET, "summary": summary,
            "trainer_MBps": main["trainer_MBps"], "raw_MBps": main["raw_MBps"], "model_mb": main["model_mb"],
            "paired": main["paired"], "modes": modes, "models": results, "settings": settings,
            "machine": machine(), "quick": quick}


def _measure_model(hidden: int, layers: int, bucket_mbs: list[float], rounds: int) -> dict:
    """Start an engine process on a fresh model of this size and measure every bucket size against it."""
    from pipelinerl.models.tiny import build_tiny_model
    from pipelinerl.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", hidden_size=hidden, num_layers=layers, seed=0)
        port = free_port()
        log_path = Path(tmp) / "engine.log"
        env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        proc = start_process([sys.executable, str(Path(__file__).resolve()), "--receiver", str(model_dir),
                              "--port", str(port)], log_path, threads=1, env=env)
        client = EngineClient(f"http://127.0.0.1:{port}")
        threads = torch.get_num_threads()  # the Trainer pins torch threads; give them back afterwards
        try:
            try:
                client.wait_healthy(timeout_s=180, process=proc)
            except Exception as e:
                raise RuntimeError(f"{e}\n--- engine log ---\n{tail(log_path)}") from e
            trainer = Trainer(str(model_dir), TrainerConfig(threads=1),
                              WeightSyncConfig(master_port=0, timeout_s=60))
            group = trainer.connect_engines([client.url])
            try:
                return {_mode_name(mb): _measure(trainer, group, client, mb, rounds) for mb in bucket_mbs}
            finally:
                group.destroy()
                trainer.close()
        finally:
            client.close()
            stop_process(proc)
            torch.set_num_threads(threads)


def _mode_name(bucket_mb: float) -> str:
    return f"bucket_{bucket_mb:g}mb" if bucket_mb > 0 else "per_tensor"


def _measure(trainer, group: WeightUpdateGroup, client: EngineClient, bucket_mb: float, rounds: int) -> dict:
    """Interleave trainer-path and raw rounds; medians of each, per-round ratios, and the engine's own
    receive/switch times."""
    trainer.sync_cfg.bucket_mb = bucket_mb
    named = list(trainer.full_parameters())
    specs = [TensorSpec.of(n, t) for n, t in named]
    sizes = _broadcast_sizes(specs, trainer.bucket_bytes)
    raw_buffers = [torch.ones(n, dtype=torch.uint8) for n in sizes]
    t: dict[str, list[float]] = {"trainer": [], "raw": [], "raw_receiver": [], "trainer_send": [],
                                 "engine_receive": [], "engine_switch": [], "other": []}

    def trainer_round() -> int:
        with _timed_sends() as sends:
            stats = trainer.broadcast_weights(group, [client.url])
        t["trainer"].append(stats.seconds)
        t["trainer_send"].append(sum(sends))
        m = client.metrics()
        t["engine_receive"].append(m["pipelinerl_last_weight_update_receive_seconds"])
        t["engine_switch"].append(m["pipelinerl_last_weight_update_switch_seconds"])
        t["other"].append(stats.seconds - t["engine_receive"][-1] - t["engine_switch"][-1])
        return stats.bytes

    def raw_round() -> None:
        sent_s, received_s = _raw_round(group, client, raw_buffers)
        t["raw"].append(sent_s)
        t["raw_receiver"].append(received_s)

    # warm-up: the first broadcast lays the trainer's parameters out for this bucket size and allocates the
    # engine's arenas; connections, buffers and page faults too
    for _ in range(2):
        nbytes = trainer_round()
        raw_round()
    for v in t.values():
        v.clear()
    for i in range(rounds):
        for fn in (trainer_round, raw_round) if i % 2 == 0 else (raw_round, trainer_round):
            fn()
    med = {k: statistics.median(v) for k, v in t.items()}
    trainer_bps, raw_bps = nbytes / med["trainer"], sum(sizes) / med["raw"]
    paired = sorted(raw / tr for raw, tr in zip(t["raw"], t["trainer"]))  # equal bytes: bytes/s ratio
    q = statistics.quantiles(paired, n=4) if len(paired) > 1 else [paired[0]] * 3
    return {"bucket_mb": bucket_mb, "broadcasts": len(sizes), "bytes": nbytes, "raw_bytes": sum(sizes),
            "model_mb": round(nbytes / 2**20, 2),
            "trainer_MBps": round(trainer_bps / 2**20, 1), "raw_MBps": round(raw_bps / 2**20, 1),
            "ratio": trainer_bps / raw_bps,
            "paired": {"median": round(statistics.median(paired), 4), "p25": round(q[0], 4),
                       "p75": round(q[2], 4), "min": round(paired[0], 4), "max": round(paired[-1], 4)},
            "median_s": {k: round(v, 5) for k, v in med.items()},
            "rounds_s": {k: [round(x, 5) for x in v] for k, v in t.items()}}


@contextmanager
def _timed_sends() -> Iterator[list[float]]:
    """Seconds of each `broadcast_tensors` call the trainer path makes (through the client module, which is
    where `push_weights` looks it up) while the block runs."""
    send = engine_client.broadcast_tensors
    seconds: list[float] = []

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return send(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    engine_client.broadcast_tensors = timed
    try:
        yield seconds
    finally:
        engine_client.broadcast_tensors = send


def _broadcast_sizes(specs: list[TensorSpec], bucket_bytes: int) -> list[int]:
    """Bytes of each broadcast the trainer's path makes (the wire format of pipelinerl.weight_sync)."""
    aligned = [(s.nbytes + ALIGN - 1) // ALIGN * ALIGN for s in specs]
    buckets = plan_buckets(specs, bucket_bytes)
    if bucket_bytes <= 0:
        return [specs[b[0]].nbytes for b in buckets]
    return [sum(aligned[i] for i in b) for b in buckets]


def _broadcast_all(group: WeightUpdateGroup, buffers: list[torch.Tensor]) -> None:
    """One broadcast per buffer, with as many in flight as the trainer path keeps (both sides call it)."""
    in_flight: deque = deque()
    for b in buffers:
        if len(in_flight) >= PIPELINE_DEPTH:
            in_flight.popleft().wait()
        in_flight.append(group.broadcast_async(b))
    while in_flight:
        in_flight.popleft().wait()


def _raw_round(group: WeightUpdateGroup, client: EngineClient, buffers: list[torch.Tensor]) -> tuple[float, float]:
    """One raw transfer: (seconds on the sender, seconds on the receiver), both after a barrier."""
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(client.post, "/bench/raw_receive", {"sizes": [b.numel() for b in buffers]})
        group.barrier()
        start = time.perf_counter()
        _broadcast_all(group, buffers)
        sent = time.perf_counter() - start
        return sent, float(reply.result()["seconds"])


# --- the engine process: the real embedded engine server plus one raw-receive route -------------------------


def _serve_receiver(model_dir: str, port: int) -> None:
    import asyncio

    import uvicorn

    from pipelinerl.contracts.routes import create_app
    from pipelinerl.engines.embedded.engine import EmbeddedEngine, EngineSettings
    from pipelinerl.engines.embedded.serve import load_model

    torch.set_num_threads(1)
    model, tokenizer = load_model(model_dir, "float32")
    settings = EngineSettings(max_running_seqs=1, max_batch_tokens=64, max_model_len=64)
    engine = EmbeddedEngine(model, model_dir, settings, tokenizer)
    app = create_app(engine, title="weight-sync benchmark receiver")
    app.router.on_shutdown.append(engine.shutdown)
    # The raw receiver's buffers, kept across rounds like the engine's staging: fresh ones would put page
    # faults (every round, for buckets above glibc's mmap threshold) into the raw time.
    raw_buffers: dict[tuple[int, ...], list[torch.Tensor]] = {}

    @app.post("/bench/raw_receive")
    async def raw_receive(body: dict) -> dict:
        if engine.receive_in_process:  # the group is the receiving process's: it receives there too
            return {"seconds": await engine.receiver.call("bare_receive", list(body["sizes"]))}
        group = engine.receiver.group  # the engine's own weight-update group, the one the trainer path uses
        sizes = tuple(body["sizes"])
        if sizes not in raw_buffers:
            raw_buffers.clear()
            raw_buffers[sizes] = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        buffers = raw_buffers[sizes]

        def receive() -> float:
            group.barrier()
            start = time.perf_counter()
            _broadcast_all(group, buffers)
            return time.perf_counter() - start

        return {"seconds": await asyncio.to_thread(receive)}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--receiver", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.receiver:
        _serve_receiver(args.receiver, args.port)
        return
    print(json.dumps(run(quick=args.quick), indent=2))


if __name__ == "__main__":
    main()
