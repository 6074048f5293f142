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
ROUNDS, QUICK_ROUNDS = 11, 3  # windows with updates; each sits between two windows without
# The engine's recommended setup on a CPU machine (`--decode-cpus`, pipelinerl/engines/embedded/cpus.py): its
# decoding on THREADS cores of its own, weight receiving and this process (the trainer's broadcast, the load)
# on the rest. Set it False to measure everything sharing every core (about 70% kept on 2 cores).
SPLIT_CPUS = True
# The engine's `--transposed-weights` (its default: auto). "none" measures the engine without transposed copies
# of the weights, which an update makes stale until they are rebuilt.
TRANSPOSED_WEIGHTS = "auto"


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
        try:
            trainer = Trainer(client, path)
            load = Load(client)
            load.wait_saturated()
            windows = _alternate_windows(client, trainer, ThreadCpu(proc.pid), window_s, rounds)
            final = client.metrics()
            settings = {**model_settings(path), "params": sum(t.numel() for _, t in trainer.states[0])}
        finally:
            if load is not None:
                load.stop()
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


def _alternate_windows(client, trainer: Trainer, cpu: ThreadCpu, window_s: float, rounds: int) -> list[dict]:
    windows = [_window(client, trainer, cpu, window_s, updates=False)]
    for _ in range(rounds):
        windows.append(_window(client, trainer, cpu, window_s, updates=True))
        windows.append(_window(client, trainer, cpu, window_s, updates=False))
    return windows


def _window(client, trainer: Trainer, cpu: ThreadCpu, window_s: float, updates: bool) -> dict:
    """Generated tokens/s over about `window_s` seconds, with or without updates pushed back to back, and
    where the CPU went: the engine's busiest thread (decoding), its other threads, this process."""
    first_push = len(trainer.pushes)
    threads_before, trainer_before = cpu.read(), time.process_time()
    before, t0 = client.metrics(), time.perf_counter()
    if updates:
        while time.perf_counter() - t0 < window_s:
            trainer.push()
    else:
        time.sleep(window_s)
    after, seconds = client.metrics(), time.perf_counter() - t0
    threads = {tid: t - threads_before.get(tid, 0.0) for tid, t in cpu.read().items()}
    trainer_cpu = time.process_time() - trainer_before

    def delta(name: str) -> float:
        return after[f"pipelinerl_{name}"] - before[f"pipelinerl_{name}"]

    tokens = delta("generated_tokens_total")
    decode_cpu = max(threads.values(), default=0.0)
    return {"updates": updates, "seconds": round(seconds, 3), "tokens": int(tokens),
            "tokens_per_s": round(tokens / seconds, 1), "pushes": len(trainer.pushes) - first_push,
            "decode_busy": round(delta("decode_seconds_total") / seconds, 3),
            "switch_fraction": round(delta("weight_update_switch_seconds_total") / seconds, 5),
            "engine_decode_thread_cores": round(decode_cpu / seconds, 3),
            "engine_other_threads_cores": round((sum(threads.values()) - decode_cpu) / seconds, 3),
            "trainer_process_cores": round(trainer_cpu / seconds, 3),
            "tokens_per_decode_cpu_s": round(tokens / decode_cpu, 1) if decode_cpu else None,
            "load_average_1m": round(os.getloadavg()[0], 2)}


def _result(model: dict, windows: list[dict], final: dict, trainer: Trainer, errors: list[str], window_s: float,
            rounds: int, split: tuple[list[int], list[int]] | None) -> dict:
    baseline, updating = _mean(windows, "tokens_per_s", False), _mean(windows, "tokens_per_s", True)
    kept = _round_ratios(windows, "tokens_per_s")
    per_cpu = (_round_ratios(windows, "tokens_per_decode_cpu_s")
               if all(w["tokens_per_decode_cpu_s"] for w in windows) else [])
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
                    f"{update_bytes / median(receive) / 2**20:.0f} MiB/s"),
        "ratio_rounds": _spread(kept),
        "ratio_per_decode_cpu_second": round(median(per_cpu), 3) if per_cpu else None,
        "ratio_per_decode_cpu_second_rounds": _spread(per_cpu) if per_cpu else None,
        "ratio_per_decode_cpu_second_is": "the same ratio per CPU second of the engine's decoding thread: what the "
                                          "updates cost decoding apart from the CPU time other processes take",
        "decode_thread_cores_without_updates": round(_mean(windows, "engine_decode_thread_cores", False), 3),
        "decode_thread_cores_with_updates": round(_mean(windows, "engine_decode_thread_cores", True), 3),
        "tokens_per_s_without_updates": round(baseline, 1),
        "tokens_per_s_with_updates": round(updating, 1),
        "updates": len(pushes),
        "update_bytes": update_bytes,
        "updates_per_s": round(len(pushes) / sum(w["seconds"] for w in windows if w["updates"]), 2),
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
                     "transposed_weights": TRANSPOSED_WEIGHTS,
                     "backend": "gloo (loopback)", "window_s": window_s, "windows_with_updates": rounds,
                     "decode_cpus": split[0] if split else "all",
                     "trainer_and_receive_cpus": split[1] if split else "all",
                     "note": ("the engine decodes on decode_cpus; its receiving threads and this process (the "
                              "trainer's broadcast, the load's clients) run on the other CPUs") if split else
                             ("the trainer (this process) and the engine share every core: the broadcast and "
                              "the engine's receiving thread compete with decoding")},
        "machine": machine(),
    }


def _round_ratios(windows: list[dict], key: str) -> list[float]:
    """For each window with updates, its `key` over the mean of the two windows without updates around it."""
    return [w[key] / ((windows[i - 1][key] + windows[i + 1][key]) / 2)
            for i, w in enumerate(windows) if w["updates"]]


def _spread(xs: list[float]) -> dict:
    return {"min": round(min(xs), 3), "median": round(median(xs), 3), "max": round(max(xs), 3)}


def _mean(windows: list[dict], key: str, updates: bool) -> float:
    values = [w[key] for w in windows if w["updates"] == updates]
    return sum(values) / len(values)


def _start_engine(path: Path, log_dir: Path, split: tuple[list[int], list[int]] | None):
    from pipelinerl.engines.client import EngineClient
    from pipelinerl.procs import engine_command, free_port, start_process, tail

    port = free_port()
    log = log_dir / f"engine-{port}.log"
    longest = MAX_NEW * 3 // 2
    extra = ["--transposed-weights", TRANSPOSED_WEIGHTS,
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
