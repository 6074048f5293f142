"""NCCL weight updates from a trainer's side (this process, on GPU 0) into the embedded engine on a GPU of its own
while it generates: the engine must hold exactly the bytes sent after every update (its per-parameter checksums),
and requests running across an update must carry tokens of more than one version. (The same into vLLM's GPU
build, with the update landing mid-generation and its log-probs checked: tests/gpu/test_vllm_gpu.py.)

Two GPUs at least: NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"), so the
trainer's side and the engine cannot share one (a one-GPU run uses gloo, `engine.colocate_with_trainer`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from pipelinerl.engines.client import EngineClient, init_group_on_engines, push_weights
from pipelinerl.engines.embedded.engine import tensor_checksums
from pipelinerl.weight_sync import WeightUpdateGroup, host_rendezvous, init_weight_update_group

from .conftest import engine_on_gpu, needs_gpus

pytestmark = [pytest.mark.slow, needs_gpus(2, "the trainer's side on GPU 0, the engine on GPU 1: NCCL refuses two "
                                                "ranks of one communicator on one GPU")]

PROMPT = [5, 6, 67, 7, 8, 71]
GROUP = "gpu_test_update"
TIMEOUT_S = 120.0
LONG = 900  # tokens per sampled request: long enough for every update to land inside them
BUCKETS = (0, 2**20, 4 * 2**20)  # one push each: per tensor (SGLang's format), then two bucket sizes


class NcclTrainer:
    """The trainer's side: the model's weights in bfloat16 on GPU 0, rank 0 of an NCCL weight-update group with
    one engine, pushing versions 1, 2, ... as a run does (`push_weights`: request posted, then broadcast)."""

    def __init__(self, client: EngineClient, model_dir: Path):
        torch.cuda.set_device(0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda:0")
        self.names = [n for n, _ in model.named_parameters()]  # a tied head follows the embedding
        self.base = {n: p.detach().clone() for n, p in model.named_parameters()}
        del model
        self.client, self.version = client, 0
        store = host_rendezvous("127.0.0.1", 2, TIMEOUT_S)
        world, futures = init_group_on_engines([client], "127.0.0.1", store.port, "nccl", GROUP, TIMEOUT_S)
        self.group: WeightUpdateGroup = init_weight_update_group("127.0.0.1", store.port, 0, world, "nccl", GROUP,
                                                                 TIMEOUT_S, store=store)
        for f in futures:
            f.result()
        assert self.group.device.type == "cuda"

    def perturbed(self, seed: int, scale: float = 0.5) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        out = {}
        for n, v in self.base.items():
            noise = torch.randn(v.shape, generator=g).to(v.device)
            out[n] = (v.float() + scale * v.float().std() * noise).to(v.dtype) if v.dim() > 1 else v.clone()
        return out

    def push(self, state: dict[str, torch.Tensor], bucket_bytes: int) -> None:
        self.version += 1
        answer = push_weights(self.group, [self.client], [(n, state[n]) for n in self.names], self.version,
                              bucket_bytes)[0]
        assert answer.version == self.version


def generate_while_pushing(client: EngineClient, trainer: NcclTrainer,
                           after_push: Callable[[dict[str, torch.Tensor]], None] = lambda state: None
                           ) -> tuple[list, dict[str, torch.Tensor]]:
    """Eight long sampled requests running while one update per bucket size lands (`after_push(weights)` after
    each); their completions and the last weights pushed."""
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(client.generate, PROMPT, temperature=1.0, max_new_tokens=LONG, ignore_eos=True,
                               seed=i) for i in range(8)]
        time.sleep(1.0)  # the requests are decoding
        state: dict[str, torch.Tensor] = {}
        for k, bucket_bytes in enumerate(BUCKETS):
            state = trainer.perturbed(seed=100 + k)
            trainer.push(state, bucket_bytes)
            after_push(state)
        results = [f.result(timeout=600) for f in futures]
    return [c for r in results for c in r.completions], state


def assert_updates_landed_mid_request(completions: list, last_version: int) -> None:
    spanning = [c for c in completions if len(set(c.versions)) > 1]
    assert spanning, "no request carried tokens of two versions: no update landed while it generated"
    for c in completions:
        assert len(c.token_ids) == LONG and c.finish_reason == "length"
        assert all(a <= b for a, b in zip(c.versions, c.versions[1:])), "versions must not go back"
        assert c.versions[-1] <= last_version


def test_nccl_updates_reach_the_embedded_engine_while_it_generates_bit_exactly(gpu_model_dir, tmp_path):
    extra = ["--dtype", "bfloat16", "--max-model-len", "1100", "--max-running-seqs", "8", "--max-batch-tokens", "8800"]
    with engine_on_gpu(gpu_model_dir, tmp_path / "engine.log", gpu=1, extra=extra) as client:
        trainer = NcclTrainer(client, gpu_model_dir)
        try:
            def check_bytes(state: dict[str, torch.Tensor]) -> None:
                # the engine's own hash of every parameter it holds, against the bytes pushed
                held = httpx.get(f"{client.url}/v1/weights/checksum", timeout=60).json()
                local = tensor_checksums(state)
                assert held["version"] == trainer.version
                assert {n: held["checksums"][n] for n in local} == local

            completions, _ = generate_while_pushing(client, trainer, check_bytes)
        finally:
            trainer.group.destroy()
        assert_updates_landed_mid_request(completions, trainer.version)
        assert client.info().weight_version == len(BUCKETS)
