"""Decode throughput kept while weight updates arrive back to back, on a real engine server process.

This process is the trainer: rank 0 of a gloo weight-update group with one embedded engine process
(`pipelinerl serve`, THREADS torch thread). CONCURRENT client threads keep the engine saturated with long
sampled requests (EOS ignored, a new request as soon as one returns; lengths drawn from MAX_NEW / 2 to
3 MAX_NEW / 2, so that requests end at different times; measured once every client has had two answered).
Generated tokens per second are read from the engine's /metrics (`pipelinerl_generated_tokens_total` over wall
time) in alternating windows of WINDOW_S seconds: without updates, then with the trainer pushing updates back
to back (`push_weights` in a loop, two weight sets alternating, in BUCKET_BYTES buckets), and so on,
starting and ending with a window without updates. Each window with updates is compared with the mean of the
two windows around it (drift in the machine's speed, from other work on it, hits a window and its neighbours
alike); `ratio` = the median of these per-round ratios of
tokens/s with updates / tokens/s without, `ratio_rounds` their min / median / max. Target: >= 0.95.

A third kind of window is the machine's share of that loss, measured in the same run: the trainer sends the
same update, in the same buckets and at the rate of the window with updates before it, to a *sink* process
(not the engine) on the engine's receiving CPUs, while the engine decodes with no update (`ratio_transfer_only`).
What moving the bytes costs decoding there (on a small VM, through cores that share execution units, caches
or memory bandwidth) any design that receives beside decoding pays; the rest of the loss is the engine's own.

Also reported per update: the decode stall (`switch_s`, and the engine's
`pipelinerl_last_weight_update_switch_seconds`), the receive time, the bandwidth (bytes / receive_s), and the
trainer's wall time per push. On a machine with few cores the trainer's broadcast and the engine's receiving
thread compete with decoding for the cores (`machine.cores` says how many there were), so each window also
records where the CPU went (per thread, from /proc): the engine's decoding thread, its other threads
(receiving), this process, and the load average (other processes). `ratio_per_decode_cpu_second` is the
ratio of tokens per CPU second of the decoding thread: below 1 when the updates slow decoding itself (stalls,
lock or memory contention), about 1 when the loss is only CPU time taken by other threads.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench.common import machine, median, model_settings, tiny_model, verdict
from pipelinerl.config import WeightSyncConfig

NAME = "engine_updates"
TARGET = 0.95
HIDDEN, LAYERS = 384, 4
CONCURRENT, PROMPT_LEN, MAX_NEW = 32, 16, 480  # MAX_NEW: the mean; each request asks for 240 to 720
THREADS = 1
# How the updates are sent: as the trainer sends them by default (`weight_sync.bucket_mb`); 0 is one broadcast
# per tensor (push_weights' default; what SGLang takes), ~5x as many broadcasts for this model.
BUCKET_BYTES = int(WeightSyncConfig().bucket_mb * 2**20)
WINDOW_S, QUICK_WINDOW_S = 4.0, 2.0
ROUNDS, QUICK_ROUNDS = 11, 3  # windows with updates, and as many with the transfer control; each between two without
# The engine's recommended setup on a CPU machine (`--decode-cpus`, pipelinerl/engines/embedded/cpus.py): its
# decoding on THREADS cores of its own, weight receiving and this process (the trainer's broadcast, the load)
# on the rest. Set it False to measure everything sharing every core (about 70% kept on 2 cores).
SPLIT_CPUS = True
# The engine's `--transposed-weights` (its default: auto). "none" measures the engine without transposed copies
# of the weights, which an update makes stale until they are rebuilt.
TRANSPOSED_WEIGHTS = "auto"
# The engine's `--update-receiver` (its default: auto, a process of its own on CPU). "thread" measures receiving
# on a thread of the engine's process, which shares the GIL with decoding.
UPDATE_RECEIVER = "auto"


def cpu_split() -> tuple[list[int], list[int]] | None:
    """(the engine's decoding CPUs, everyone else's), or None when there are too few CPUs to split."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not SPLIT_CPUS or len(allowed) <= THREADS:
        return None
    return allowed[:THREADS], allowed[THREADS:]


def run(quick: bool = False) -> dict:
    """Start an engine, saturate it, alternate windows without and with updates; returns the result."""
    torch.set_num_threads(THREADS)
    window_s, rounds = (QUICK_WINDOW_S, QUICK_ROUNDS) if quick else (WINDOW_S, ROUNDS)
    split = cpu_split()
    allowed = os.sched_getaffinity(0) if split else None
    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_model(tmp, HIDDEN, LAYERS)
        client, proc = _start_engine(path, Path(tmp), split)
        if split:
            os.sched_setaffinity(0, split[1])  # this thread, and the threads it starts from now on

        trainer = None
        load = None
        control = None
        try:
            trainer = Trainer(client, path)
            control = TransferControl([t for _, t in trainer.states[0]], split[1] if split else None)
            load = Load(client)
            load.wait_saturated()
            windows = _alternate_windows(client, trainer, control, ThreadCpu(proc.pid), window_s, rounds)
            final = client.metrics()
            settings = {**model_settings(path), "params": sum(t.numel() for _, t in trainer.states[0])}
        finally:
            if load is not None:
                load.stop()
            if control is not None:
                control.close()
            if trainer is not None:
                trainer.close()
            client.close()
            _stop(proc)
            if allowed:
                os.sched_setaffinity(0, allowed)
    return _result(settings, windows, final, trainer, load.errors, window_s, rounds, split)


class Trainer:
    """Rank 0 of the weight-update group, holding two weight sets to alternate between."""

    def __init__(self, client, path: Path):
        from transformers import AutoModelForCausalLM

        from pipelinerl.engines.client import init_group_on_engines
        from pipelinerl.procs import free_port
        from pipelinerl.weight_sync import init_weight_update_group

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        base = [(n, p.detach().clone()) for n, p in model.named_parameters()]  # deduplicated, like the trainer
        g = torch.Generator().manual_seed(0)
        nudged = [(n, t + 0.01 * t.std() * torch.randn(t.shape, generator=g) if t.dim() > 1 else t.clone())
                  for n, t in base]
        self.states = [base, nudged]
        self.client, self.version = client, 0
        self.pushes: list[dict] = []
        port = free_port()
        world, futures = init_group_on_engines([client], "127.0.0.1", port, "gloo", "weight_update", 60)
        self.group = init_weight_update_group("127.0.0.1", port, 0, world, "gloo", timeout_s=60)
        for f in futures:
            f.result()

    def push(self) -> None:
        from pipelinerl.engines.client import push_weights

        self.version += 1
        t0 = time.perf_counter()
        resp = push_weights(self.group, [self.client], self.states[self.version % 2], self.version, BUCKET_BYTES)[0]
        self.pushes.append({"wall_s": time.perf_counter() - t0, "receive_s": resp.receive_s,
                            "switch_s": resp.switch_s, "bytes": resp.received_bytes})

    def close(self) -> None:
        self.group.destroy()


class TransferControl:
    """The same update, sent the same way, to a sink process instead of the engine: rank 0 of a second gloo
    group whose rank 1 (`_sink`, on `cpus`) only receives it into buffers laid out as the wire lays it out, as
    the engine does, and does nothing else with it."""

    def __init__(self, tensors: list[torch.Tensor], cpus: list[int] | None):
        from pipelinerl.procs import free_port
        from pipelinerl.weight_sync import TensorSpec, init_weight_update_group

        self.tensors, self.pushes = tensors, 0
        specs = [TensorSpec.of(str(i), t) for i, t in enumerate(tensors)]
        port = free_port()
        self.proc = multiprocessing.get_context("spawn").Process(
            target=_sink, args=(port, specs, BUCKET_BYTES, cpus), daemon=True)
        self.proc.start()
        self.group = init_weight_update_group("127.0.0.1", port, 0, 2, "gloo", "transfer_control", timeout_s=60)
        self._command = torch.ones(1, dtype=torch.int64)

    def push(self) -> None:
        from pipelinerl.weight_sync import broadcast_tensors

        self.group.broadcast(self._command)  # 1: an update follows
        broadcast_tensors(self.group, self.tensors, BUCKET_BYTES)
        self.pushes += 1

    def close(self) -> None:
        try:
            self.group.broadcast(torch.zeros(1, dtype=torch.int64))  # 0: stop
        finally:
            self.group.destroy()
            self.proc.join(timeout=30)
            if self.proc.is_alive():
                self.proc.kill()


def _sink(port: int, specs: list, bucket_bytes: int, cpus: list[int] | None) -> None:
    """TransferControl's rank 1: receive updates until told to stop."""
    from pipelinerl.weight_sync import init_weight_update_group, receive_tensors, wire_buffers

    if cpus:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(THREADS)
    group = init_weight_update_group("127.0.0.1", port, 1, 2, "gloo", "transfer_control", timeout_s=60)
    out = wire_buffers(specs, bucket_bytes, group.device)
    command = torch.zeros(1, dtype=torch.int64)
    try:
        while True:
            group.broadcast(command)
            if not command.item():
                return
            receive_tensors(group, specs, bucket_bytes, out)
    finally:
        group.destroy()


class Load:
    """CONCURRENT threads, each posting one long sampled request after another until stopped."""

    def __init__(self, client):
        self.client = client
        self.stopping = threading.Event()
        self.errors: list[str] = []
        self.finished = [0] * CONCURRENT  # requests each client has had answered
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(CONCURRENT)]
        for t in self.threads:
            t.start()

    def _loop(self, i: int) -> None:
        prompt = [4 + (i * 7 + j) % 90 for j in range(PROMPT_LEN)]
        # Lengths drawn around MAX_NEW, so that requests end at different times, as in a real workload: all of
        # one length would end together, and tokens/s would rise and fall with their common position.
        lengths = random.Random(i)
        while not self.stopping.is_set():
            max_new = lengths.randint(MAX_NEW // 2, MAX_NEW * 3 // 2)
            try:
                self.client.generate(prompt, temperature=1.0, max_new_tokens=max_new, ignore_eos=True)
                self.finished[i] += 1
            except Exception as e:  # reported in the result; the benchmark goes on
                self.errors.append(f"{type(e).__name__}: {e}"[:200])
                time.sleep(0.1)

    def wait_saturated(self, timeout_s: float = 180.0) -> None:
        """Until every client has had two requests answered: the first requests all start together, so their
        positions (and the cost of a step, which grows with the longest) move in step for a while."""
        deadline = time.monotonic() + timeout_s
        while min(self.finished) < 2 or self.client.metrics()["pipelinerl_running_seqs"] < CONCURRENT:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine never answered every client and ran {CONCURRENT} sequences at once")
            time.sleep(0.05)

    def stop(self) -> None:
        self.stopping.set()
        try:
            self.client.abort()  # ends the running requests now instead of after MAX_NEW tokens
        except Exception:
            pass
        for t in self.threads:
            t.join(timeout=30)


class ThreadCpu:
    """CPU seconds per thread of a local process, from /proc (empty where there is no /proc)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def read(self) -> dict[int, float]:
        out = {}
        try:
            tids = os.listdir(f"/proc/{self.pid}/task")
        except OSError:
            return out
        for tid in tids:
            try:
                fields = Path(f"/proc/{self.pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[int(tid)] = (int(fields[11]) + int(fields[12])) / self.tick  # utime + stime
        return out


def _alternate_windows(client, trainer: Trainer, control: TransferControl, cpu: ThreadCpu, window_s: float,
                       rounds: int) -> list[dict]:
    """none, updates, none, transfer, none, updates, ...: every window with updates or with the transfer
    control between two without."""
    def window(kind: str, interval: float = 0.0) -> dict:
        return _window(client, trainer, control, cpu, window_s, kind, interval)

    windows = [window("none")]
    for _ in range(rounds):
        updates = window("updates")
        windows += [updates, window("none")]
        windows += [window("transfer", updates["seconds"] / max(updates["pushes"], 1)), window("none")]
    return windows


def _window(client, trainer: Trainer, control: TransferControl, cpu: ThreadCpu, window_s: float,
            kind: str, interval: float = 0.0) -> dict:
    """Generated tokens/s over about `window_s` seconds, and where the CPU went: the engine's busiest thread
    (decoding), its other threads, this process. `kind`: "none"; "updates", pushed back to back; "transfer",
    the same update sent to the sink once every `interval` seconds."""
    first_push = len(trainer.pushes)
    first_transfer = control.pushes
    threads_before, trainer_before = cpu.read(), time.process_time()
    before, t0 = client.metrics(), time.perf_counter()
    if kind == "updates":
        while time.perf_counter() - t0 < window_s:
            trainer.push()
    elif kind == "transfer":
        while time.perf_counter() - t0 < window_s:
            start = time.perf_counter()
            control.push()
            time.sleep(max(0.0, interval - (time.perf_counter() - start)))
    else:
        time.sleep(window_s)
    after, seconds = client.metrics(), time.perf_counter() - t0
    threads = {tid: t - threads_before.get(tid, 0.0) for tid, t in cpu.read().items()}
    trainer_cpu = time.process_time() - trainer_before

    def delta(name: str) -> float:
        return after[f"pipelinerl_{name}"] - before[f"pipelinerl_{name}"]

    tokens = delta("generated_tokens_total")
    decode_cpu = max(threads.values(), default=0.0)
    return {"kind": kind, "seconds": round(seconds, 3), "tokens": int(tokens),
            "tokens_per_s": round(tokens / seconds, 1), "pushes": len(trainer.pushes) - first_push,
            "transfers": control.pushes - first_transfer,
            "decode_busy": round(delta("decode_seconds_total") / seconds, 3),
            "switch_fraction": round(delta("weight_update_switch_seconds_total") / seconds, 5),
            "engine_decode_thread_cores": round(decode_cpu / seconds, 3),
            "engine_other_threads_cores": round((sum(threads.values()) - decode_cpu) / seconds, 3),
            "trainer_process_cores": round(trainer_cpu / seconds, 3),
            "tokens_per_decode_cpu_s": round(tokens / decode_cpu, 1) if decode_cpu else None,
            "load_average_1m": round(os.getloadavg()[0], 2)}


def _result(model: dict, windows: list[dict], final: dict, trainer: Trainer, errors: list[str], window_s: float,
            rounds: int, split: tuple[list[int], list[int]] | None) -> dict:
    baseline, updating = _mean(windows, "tokens_per_s", "none"), _mean(windows, "tokens_per_s", "updates")
    kept = _round_ratios(windows, "tokens_per_s", "updates")
    kept_transfer = _round_ratios(windows, "tokens_per_s", "transfer")
    has_cpu = all(w["tokens_per_decode_cpu_s"] for w in windows)
    per_cpu = _round_ratios(windows, "tokens_per_decode_cpu_s", "updates") if has_cpu else []
    per_cpu_transfer = _round_ratios(windows, "tokens_per_decode_cpu_s", "transfer") if has_cpu else []
    pushes = trainer.pushes
    receive = [p["receive_s"] for p in pushes]
    switch = [p["switch_s"] for p in pushes]
    update_bytes = pushes[0]["bytes"] if pushes else 0
    ratio = median(kept)
    return {
        "name": NAME,
        **verdict(ratio, TARGET),
        "ratio_is": "generated tokens/s while updates arrive back to back / tokens/s without updates (median of "
                    "the rounds, each against the windows around it)",
        "summary": (f"{ratio:.1%} kept (rounds {min(kept):.0%}-{max(kept):.0%}; {updating:.0f} vs {baseline:.0f} "
                    f"tok/s), {model['params'] / 1e6:.1f}M-param model, {len(pushes)} updates of "
                    f"{update_bytes / 2**20:.1f} MiB, stall {median(switch) * 1e3:.2f} ms, "
                    f"{update_bytes / median(receive) / 2**20:.0f} MiB/s; the same transfer to a sink process "
                    f"instead: {median(kept_transfer):.1%} kept"),
        "ratio_rounds": _spread(kept),
        "ratio_transfer_only": round(median(kept_transfer), 3),
        "ratio_transfer_only_rounds": _spread(kept_transfer),
        "ratio_transfer_only_is": "tokens/s while this process sends the same update, at the rate of the window "
                                  "with updates before, to a sink process on the engine's receiving CPUs instead "
                                  "of the engine / tokens/s without: what moving the bytes beside decoding costs "
                                  "on this machine, apart from the engine",
        "ratio_per_decode_cpu_second": round(median(per_cpu), 3) if per_cpu else None,
        "ratio_per_decode_cpu_second_rounds": _spread(per_cpu) if per_cpu else None,
        "ratio_per_decode_cpu_second_is": "the same ratio per CPU second of the engine's decoding thread: what the "
                                          "updates cost decoding apart from the CPU time other processes take",
        "ratio_per_decode_cpu_second_transfer_only": round(median(per_cpu_transfer), 3) if per_cpu else None,
        "decode_thread_cores_without_updates": round(_mean(windows, "engine_decode_thread_cores", "none"), 3),
        "decode_thread_cores_with_updates": round(_mean(windows, "engine_decode_thread_cores", "updates"), 3),
        "decode_thread_cores_transfer_only": round(_mean(windows, "engine_decode_thread_cores", "transfer"), 3),
        "tokens_per_s_without_updates": round(baseline, 1),
        "tokens_per_s_with_updates": round(updating, 1),
        "updates": len(pushes),
        "update_bytes": update_bytes,
        "updates_per_s": round(len(pushes) / sum(w["seconds"] for w in windows if w["kind"] == "updates"), 2),
        "transfers_per_s": round(sum(w["transfers"] for w in windows)
                                 / sum(w["seconds"] for w in windows if w["kind"] == "transfer"), 2),
        "switch_s_median": round(median(switch), 5),
        "switch_s_max": round(max(switch), 5),
        "last_weight_update_switch_seconds": final["pipelinerl_last_weight_update_switch_seconds"],
        "receive_s_median": round(median(receive), 4),
        "bandwidth_mib_per_s": round(update_bytes / median(receive) / 2**20, 1),
        "push_wall_s_median": round(median([p["wall_s"] for p in pushes]), 4),
        "windows": windows,
        "load_errors": errors[:10],
        "settings": {"model": model, "engine_threads": THREADS, "trainer_threads": THREADS,
                     "concurrent_requests": CONCURRENT, "prompt_len": PROMPT_LEN,
                     "max_new_tokens": [MAX_NEW // 2, MAX_NEW * 3 // 2],
                     "sampling": "temperature 1.0, EOS ignored", "bucket_bytes": BUCKET_BYTES,
                     "transposed_weights": TRANSPOSED_WEIGHTS, "update_receiver": UPDATE_RECEIVER,
                     "backend": "gloo (loopback)", "window_s": window_s, "windows_with_updates": rounds,
                     "decode_cpus": split[0] if split else "all",
                     "trainer_and_receive_cpus": split[1] if split else "all",
                     "note": ("the engine decodes on decode_cpus; its receiving threads and this process (the "
                              "trainer's broadcast, the load's clients) run on the other CPUs") if split else
                             ("the trainer (this process) and the engine share every core: the broadcast and "
                              "the engine's receiving thread compete with decoding")},
        "machine": machine(),
    }


def _round_ratios(windows: list[dict], key: str, kind: str) -> list[float]:
    """For each window of `kind`, its `key` over the mean of the two windows without updates around it."""
    return [w[key] / ((windows[i - 1][key] + windows[i + 1][key]) / 2)
            for i, w in enumerate(windows) if w["kind"] == kind]


def _spread(xs: list[float]) -> dict:
    return {"min": round(min(xs), 3), "median": round(median(xs), 3), "max": round(max(xs), 3)}


def _mean(windows: list[dict], key: str, kind: str) -> float:
    values = [w[key] for w in windows if w["kind"] == kind]
    return sum(values) / len(values)


def _start_engine(path: Path, log_dir: Path, split: tuple[list[int], list[int]] | None):
    from pipelinerl.engines.client import EngineClient
    from pipelinerl.procs import engine_command, free_port, start_process, tail

    port = free_port()
    log = log_dir / f"engine-{port}.log"
    longest = MAX_NEW * 3 // 2
    extra = ["--transposed-weights", TRANSPOSED_WEIGHTS, "--update-receiver", UPDATE_RECEIVER,
             "--max-running-seqs", str(CONCURRENT), "--max-model-len", str(PROMPT_LEN + longest),
             "--max-batch-tokens", str(CONCURRENT * (PROMPT_LEN + longest)), "--threads", str(THREADS)]
    if split:
        extra += ["--decode-cpus", ",".join(map(str, split[0]))]
    proc = start_process(engine_command(str(path), port, extra=extra), log, threads=THREADS)
    client = EngineClient(f"http://127.0.0.1:{port}", timeout_s=120)
    try:
        client.wait_healthy(timeout_s=120, process=proc)
    except Exception as e:
        client.close()
        _stop(proc)
        raise RuntimeError(f"{e}\n--- engine log ---\n{tail(log)}") from e
    return client, proc


def _stop(proc) -> None:
    from pipelinerl.procs import stop_process

    stop_process(proc)
