"""One bad request never costs another request its answer: refused at the edge where its parameters are out of
the contract's bounds, and, beneath validation, failed alone where its parameters still break a step of the
batch it shares (the embedded engine admits the batch's requests one at a time, or samples the step row by row,
and answers only the one that fails alone with the error). Every other request is answered 200, with the tokens
it gets without the bad one beside it."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
import torch
from conftest import running_engine
from transformers import AutoModelForCausalLM

import pipelinerl.engines.embedded.scheduler as scheduler_module
from pipelinerl.contracts.inference import GenerateRequest, SamplingParams
from pipelinerl.contracts.routes import ContractError
from pipelinerl.engines.embedded.engine import EmbeddedEngine, EngineSettings

PROMPTS = [[5 + i, 6, 67, 7, 8] for i in range(8)]
BAD_TOP_K = 8354693991844048242084937728  # the value that failed a whole batch of the embedded engine


def good_params(i: int) -> SamplingParams:
    """Sampled with a seed (the same tokens whatever shares the batch), and one greedy."""
    return SamplingParams(temperature=0 if i == 0 else 1.0, seed=100 + i, max_new_tokens=12, ignore_eos=True)


def body(prompt: list[int], sampling: dict) -> dict:
    return {"prompt_token_ids": prompt, "sampling": sampling}


def test_a_top_k_past_any_bound_is_refused_alone_over_http(tiny_model_dir, tmp_path):
    with running_engine(tiny_model_dir, tmp_path, extra=["--max-running-seqs", "16"]) as client:
        url = f"{client.url}/v1/generate"
        goods = [body(p, good_params(i).model_dump()) for i, p in enumerate(PROMPTS)]
        alone = [httpx.post(url, json=b, timeout=60).json()["completions"][0]["token_ids"] for b in goods]
        bad = body(PROMPTS[0], {"top_k": BAD_TOP_K, "max_new_tokens": 12})
        answers: dict[int, httpx.Response] = {}

        def send(i: int, b: dict) -> None:
            answers[i] = httpx.post(url, json=b, timeout=60)

        threads = [threading.Thread(target=send, args=(i, b)) for i, b in enumerate([*goods, bad])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        refused = answers[len(goods)]
        assert refused.status_code == 400 and refused.json()["error"]["field"] == "sampling.top_k", refused.text
        for i in range(len(goods)):
            assert answers[i].status_code == 200, answers[i].text
            assert answers[i].json()["completions"][0]["token_ids"] == alone[i]
        # the bounds are the schema's, so every client can read them
        schema = httpx.get(f"{client.url}/openapi.json").json()["components"]["schemas"]["SamplingParams"]
        assert schema["properties"]["top_k"]["maximum"] == 2**31 - 1


@pytest.fixture
def engine(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    e = EmbeddedEngine(model, str(tiny_model_dir), EngineSettings(max_running_seqs=16, max_model_len=64))
    yield e
    e.shutdown()


def run_batch(engine: EmbeddedEngine, requests: list[GenerateRequest]) -> list:
    async def together():
        return await asyncio.gather(*(engine.generate(r) for r in requests), return_exceptions=True)

    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(together())
    finally:
        loop.close()


BAD_TEMPERATURE = 0.777  # the request whose rows the patched sampler cannot take


def breaking_sampler(monkeypatch, when):
    """sample_batch that raises, beneath validation, for a batch with a BAD_TEMPERATURE row when `when(calls)`."""
    real = scheduler_module.sample_batch
    calls = {"n": 0}

    def patched(logits, batch):
        if logits.shape[1] > 2:  # not the submission's probe (two-token logits)
            calls["n"] += 1
            if bool((batch.temperature == torch.tensor(BAD_TEMPERATURE)).any()) and when(calls["n"]):
                raise RuntimeError("this row breaks the sampler")
        return real(logits, batch)

    monkeypatch.setattr(scheduler_module, "sample_batch", patched)


@pytest.mark.parametrize("phase", ["admission", "decode"])
def test_a_request_that_breaks_a_step_fails_alone(engine, monkeypatch, phase):
    goods = [GenerateRequest(prompt_token_ids=p, sampling=good_params(i)) for i, p in enumerate(PROMPTS)]
    alone = [r.completions[0].token_ids for r in run_batch(engine, goods)]
    bad = GenerateRequest(prompt_token_ids=PROMPTS[1], sampling=SamplingParams(
        temperature=BAD_TEMPERATURE, max_new_tokens=12, ignore_eos=True, seed=7))
    # admission: the prefill's sampling fails; decode: the third decode step's
    breaking_sampler(monkeypatch, (lambda n: True) if phase == "admission" else (lambda n: n >= 4))
    answers = run_batch(engine, [*goods[:4], bad, *goods[4:]])
    failed = answers[4]
    assert isinstance(failed, ContractError) and failed.status == 500 and "this row breaks the sampler" in \
        failed.message, failed
    others = answers[:4] + answers[5:]
    assert [r.completions[0].token_ids for r in others] == alone
    assert all(r.completions[0].finish_reason == "length" for r in others)
    # and the engine serves on, the bad request's parameters included once they no longer break anything
    monkeypatch.undo()
    again = run_batch(engine, [bad, *goods])
    assert [r.completions[0].token_ids for r in again[1:]] == alone and len(again[0].completions[0].token_ids) == 12
