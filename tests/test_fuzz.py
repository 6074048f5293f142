"""Schema-driven fuzzing of the engines' HTTP front: schemathesis generates requests from the contract's OpenAPI
document (contracts/openapi.json), valid and invalid ones, for every route, and sends them to a real engine
server process. Every answer must be documented and valid against the document, every error the contract's
envelope, bad input a 4xx, and nothing a 5xx except the two the contract prescribes for valid input here:

- `POST /v1/weights/init_group` over gloo answers 504 (`weight_sync_error`) when no trainer hosts the group: the
  fuzzer cannot be the trainer. Its rendezvous is aimed at a loopback port that this test holds closed and its
  timeout cut to `JOIN_TIMEOUT_S`, so such a join fails at once instead of waiting (up to a day, as the contract
  allows) and never reaches another process on this machine.
- `GET /v1/weights/checksum` answers 501 on vLLM, which has no per-parameter weights to hash (see its front).

Afterwards the engine must still serve: a greedy generation matches transformers and, on the embedded engine,
the weights are bit-identical to before. The model here has more embedding rows than its tokenizer has tokens
(as Qwen2.5 does) and is biased to generate an id past the tokenizer, the case the fuzzer first found a 500 in.

Budget: `FUZZ_EXAMPLES` examples per operation in schemathesis' fuzzing phase, plus its coverage phase (boundary
values, wrong types, missing fields, unexpected methods and content types). PIPELINERL_FUZZ_EXAMPLES and
PIPELINERL_FUZZ_SEED change both for a longer or a different run.
"""

import collections
import contextlib
import json
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from conftest import running_engine
from test_vllm import needs_vllm, running_vllm, vllm_imports, vllm_model_dir  # noqa: F401 (fixtures)
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from pipelinerl.engines.client import EngineClient
from pipelinerl.models.tiny import build_char_tokenizer

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the dev extra: pip install -e '.[dev]'")

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = ROOT / "contracts" / "openapi.json"
FUZZ_EXAMPLES = int(os.environ.get("PIPELINERL_FUZZ_EXAMPLES", "20"))
FUZZ_SEED = int(os.environ.get("PIPELINERL_FUZZ_SEED", "0"))
JOIN_TIMEOUT_S = 0.2
REQUEST_TIMEOUT_S = 60.0
# rows of the embedding past the tokenizer's ids, and the one the model is biased towards
EXTRA_ROWS = 8
BIASED_OFFSET = 5
PROMPT_TEXT = "1+1="


# --- the model: more embedding rows than tokenizer ids ---------------------------------------------------------


def build_model_past_its_tokenizer(out_dir: Path) -> Path:
    """A tiny Qwen2 model whose embedding has EXTRA_ROWS rows more than its (character) tokenizer has ids, biased
    to generate id len(tokenizer) + BIASED_OFFSET: every input embedding gets a large component along hidden
    dimension 0, and only that id's (untied) output row reads it. Greedy decoding picks that id at every step,
    with log-probs of about -0.2, -0.06, ... (the random layers still move the hidden state), and sampling at
    higher temperatures picks other ids too."""
    tokenizer = build_char_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer) + EXTRA_ROWS, hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
                         max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(1234)
    model = Qwen2ForCausalLM(config)
    biased = len(tokenizer) + BIASED_OFFSET
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] += 10.0
        model.lm_head.weight[biased] = 0.0
        model.lm_head.weight[biased, 0] = 10.0
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def reference_greedy(model_dir: Path, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs from transformers (float32), one full forward per step."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], -1)
            ids.append(int(logp.argmax()))
            logprobs.append(float(logp[ids[-1]]))
    return ids[len(prompt):], logprobs


def assert_generates_like_transformers(engine: EngineClient, model_dir: Path, prompt: list[int]) -> None:
    out = engine.generate(prompt, temperature=0, max_new_tokens=6, ignore_eos=True).completions[0]
    tokens, logprobs = reference_greedy(model_dir, prompt, 6)
    assert out.token_ids == tokens, (out.token_ids, tokens)
    assert out.logprobs == pytest.approx(logprobs, abs=2e-3), (out.logprobs, logprobs)


# --- the fuzzer --------------------------------------------------------------------------------------------------


@dataclass
class FuzzLog:
    """What the fuzzer sent and got: requests per (operation, status)."""

    statuses: collections.Counter = field(default_factory=collections.Counter)

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())

    def summary(self) -> str:
        by_status = collections.Counter()
        for (_, status), n in self.statuses.items():
            by_status[status] += n
        lines = [f"{self.requests} requests, by status: {dict(sorted(by_status.items()))}"]
        for label in sorted({label for label, _ in self.statuses}):
            lines.append(f"  {label}: " + ", ".join(f"{n} x {status}" for (other, status), n
                                                     in sorted(self.statuses.items()) if other == label))
        return "\n".join(lines)


def contract_schema(server_errors: dict[str, list[str]]) -> Any:
    """The contract's OpenAPI document as schemathesis' schema, with the 5xx `server_errors` allows per path (see
    the module docstring) and nothing else beyond 4xx. The server's URL is given to each call (it is known only
    once the server runs; schemathesis' `from_fixture`, which would take it from a fixture, does not work with
    pytest 9.2)."""
    allowed = ["2xx", "400", "409"]  # a valid request is served, or refused for what the schema cannot say
    operations = [{"include-path": path,
                   "checks": {"not_a_server_error": {"expected-statuses": ["2xx", "4xx", *extra]},
                              "positive_data_acceptance": {"expected-statuses": [*allowed, *extra]}}}
                  for path, extra in server_errors.items()]
    config = schemathesis.Config.from_dict({
        "seed": FUZZ_SEED,
        "request-timeout": REQUEST_TIMEOUT_S,
        "generation": {"mode": "all", "max-examples": FUZZ_EXAMPLES, "database": "none"},
        "checks": {"positive_data_acceptance": {"expected-statuses": allowed}},
        "operations": operations,
    })
    return schemathesis.openapi.from_path(CONTRACT, config=config)


def error_envelope(ctx: Any, response: Any, case: Any) -> bool | None:
    """Every error of every route, documented or not (an unexpected method's 405 too), is the contract's
    envelope and nothing else; a 5xx only where the module docstring says."""
    if response.status_code < 400 or case.method.upper() == "HEAD":  # HEAD: the headers of a GET, no body
        return None
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(f"{response.status_code} with a body that is not JSON: {response.content[:200]!r}") \
            from None
    error = body.get("error") if isinstance(body, dict) else None
    assert isinstance(error, dict) and set(body) == {"error"} and set(error) == {"type", "message", "field"}, body
    assert isinstance(error["type"], str) and isinstance(error["message"], str) and error["message"], body
    assert error["field"] is None or isinstance(error["field"], str), body
    if response.status_code >= 500:
        expected = {504: "weight_sync_error", 501: "not_implemented"}.get(response.status_code)
        assert error["type"] == expected, f"{case.method} {case.path}: {response.status_code} {body}"
    return None


def aim_rendezvous(case: Any, closed_port: int) -> None:
    """A valid gloo init_group would wait up to its timeout for a trainer at any address (module docstring):
    point it at `closed_port` on loopback, with a short timeout. Invalid requests go as generated (they must be
    refused before any join)."""
    body = case.body
    if (case.operation.path != "/v1/weights/init_group" or not isinstance(body, dict)
            or case.meta is None or not case.meta.generation.mode.is_positive):
        return
    body["master_address"], body["master_port"] = "127.0.0.1", closed_port
    body["timeout_s"] = min(body.get("timeout_s", JOIN_TIMEOUT_S), JOIN_TIMEOUT_S)


def fuzz_case(case: Any, url: str, log: FuzzLog, closed_port: int, headers: dict | None = None) -> None:
    aim_rendezvous(case, closed_port)
    response = case.call(base_url=url, headers=headers)
    log.statuses[(case.operation.label, response.status_code)] += 1
    case.validate_response(response, additional_checks=[error_envelope], transport_kwargs={"base_url": url})


@pytest.fixture(scope="module")
def closed_port() -> Iterator[int]:
    """A loopback port bound by this process and not listening: a connection to it is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


# --- the embedded engine ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def biased_model_dir(tmp_path_factory) -> Path:
    return build_model_past_its_tokenizer(tmp_path_factory.mktemp("model_past_tokenizer"))


FUZZ_KEY = "fuzz-api-key"
AUTH = {"Authorization": f"Bearer {FUZZ_KEY}"}


@pytest.fixture(scope="module")
def embedded(biased_model_dir, tmp_path_factory) -> Iterator[EngineClient]:
    """With an API key, as every engine of a run has one: the fuzzer sends it (the weights routes are fuzzed
    behind it, as a trainer reaches them), and the clients here read it from the environment."""
    # a short context and few sequences keep every generation the fuzzer asks for short
    extra = ["--max-model-len", "64", "--max-running-seqs", "8", "--max-batch-tokens", "1024"]
    with keyed(), running_engine(biased_model_dir, tmp_path_factory.mktemp("logs"), extra=extra) as client:
        yield client


@pytest.fixture(scope="module")
def embedded_log() -> FuzzLog:
    return FuzzLog()


@pytest.fixture(scope="module")
def embedded_checksums(embedded) -> dict[str, str]:
    """The weights' checksums before any fuzzing."""
    return httpx.get(f"{embedded.url}/v1/weights/checksum", headers=AUTH, timeout=60).json()["checksums"]


def test_completions_name_token_ids_past_the_tokenizer(embedded, biased_model_dir):
    """An id the model generates but the tokenizer has no string for is "" in `logprobs.tokens` and adds nothing
    to the text (it was a 500: transformers names such an id None)."""
    tokenizer = build_char_tokenizer()
    biased = len(tokenizer) + BIASED_OFFSET
    prompt = tokenizer.encode(PROMPT_TEXT)
    generated = embedded.generate(prompt, temperature=0, max_new_tokens=4, ignore_eos=True).completions[0]
    assert generated.token_ids == [biased] * 4, generated  # the model does generate past its tokenizer
    r = httpx.post(f"{embedded.url}/v1/completions", timeout=60, headers=AUTH, json={
        "prompt": PROMPT_TEXT, "max_tokens": 4, "temperature": 0, "logprobs": 1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["logprobs"]["tokens"] == [""] * 4
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(generated.logprobs, abs=1e-5)
    assert choice["text"] == "" and choice["finish_reason"] == "length"
    # sampled, the text holds the characters of the ids the tokenizer has and nothing for the others
    r = httpx.post(f"{embedded.url}/v1/completions", timeout=60, headers=AUTH, json={
        "prompt": PROMPT_TEXT, "max_tokens": 32, "temperature": 5, "seed": 3, "logprobs": 1, "n": 4})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        tokens = choice["logprobs"]["tokens"]
        assert "" in tokens and any(tokens), tokens  # both kinds of id were sampled
        assert choice["text"] == "".join(t for t in tokens if t not in tokenizer.all_special_tokens)


GENERATE = {"prompt_token_ids": [5, 6]}


@pytest.mark.parametrize("method, path, content, content_type, status, field", [
    ("GET", "/v1/nowhere", None, None, 404, None),
    ("GET", "/v1/generate", None, None, 405, None),
    ("DELETE", "/v1/health", None, None, 405, None),
    ("POST", "/v1/generate", b"{not json", "application/json", 400, "body"),
    ("POST", "/v1/generate", b"[5, 6]", "application/json", 400, "body"),
    ("POST", "/v1/generate", b'"text"', "application/json", 400, "body"),
    ("POST", "/v1/generate", b"", "application/json", 400, "body"),
    ("POST", "/v1/generate", json.dumps(GENERATE).encode(), "text/plain", 400, "body"),
    ("POST", "/v1/generate", json.dumps(GENERATE).encode(), None, 400, "body"),
    ("POST", "/v1/generate", b"\xff\xfe", "application/json; charset=nonsense", 400, "body"),
    ("POST", "/v1/generate", b'{"prompt_token_ids": [5], "sampling": {"temperature": NaN}}', "application/json", 400,
     "sampling.temperature"),
    ("POST", "/v1/generate", b'{"prompt_token_ids": [5], "sampling": {"top_p": 1e999}}', "application/json", 400,
     "sampling.top_p"),
])
def test_every_error_is_the_contract_envelope(embedded, method, path, content, content_type, status, field):
    headers = {**AUTH, **({"content-type": content_type} if content_type else {})}
    r = httpx.request(method, f"{embedded.url}{path}", content=content, headers=headers, timeout=60)
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"} and r.json()["error"]["field"] == field and r.json()["error"]["message"], r.text


@pytest.mark.parametrize("sampling, field", [
    ({"seed": False}, "sampling.seed"),
    ({"max_new_tokens": "5"}, "sampling.max_new_tokens"),
    ({"max_new_tokens": 5.0}, "sampling.max_new_tokens"),
    ({"n": True}, "sampling.n"),
    ({"ignore_eos": 0}, "sampling.ignore_eos"),
    ({"ignore_eos": "true"}, "sampling.ignore_eos"),
    ({"temperature": "1"}, "sampling.temperature"),
    ({"temperature": True}, "sampling.temperature"),
    ({"stop_token_ids": [1.0]}, "sampling.stop_token_ids.0"),
    ({"seed": 2**53}, "sampling.seed"),
])
def test_numbers_and_booleans_are_taken_only_as_their_json_type(embedded, sampling, field):
    r = httpx.post(f"{embedded.url}/v1/generate", json={**GENERATE, "sampling": sampling}, headers=AUTH, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["field"] == field, r.text


def test_json_integers_are_numbers(embedded):
    r = httpx.post(f"{embedded.url}/v1/generate", timeout=60, headers=AUTH, json={
        **GENERATE, "sampling": {"temperature": 1, "top_p": 1, "max_new_tokens": 2, "seed": 2**53 - 1}})
    assert r.status_code == 200, r.text


def test_temperatures_near_zero_are_greedy(embedded):
    """Below 1e-5 a temperature is greedy decoding (as in vLLM): dividing the logits by a float32-subnormal one
    (below ~1e-38) gave NaN log-probs, sent as null, and token 0."""
    prompt = build_char_tokenizer().encode(PROMPT_TEXT)
    greedy = embedded.generate(prompt, temperature=0, max_new_tokens=4, ignore_eos=True).completions[0]
    for temperature in (1e-45, 1e-39, 1e-6):
        out = embedded.generate(prompt, temperature=temperature, max_new_tokens=4, ignore_eos=True).completions[0]
        assert (out.token_ids, out.logprobs) == (greedy.token_ids, greedy.logprobs), temperature


embedded_contract = contract_schema({"/v1/weights/init_group": ["504"]})


@embedded_contract.parametrize()
def test_embedded_engine_answers_every_request_by_its_contract(case, embedded, embedded_checksums, embedded_log,
                                                               closed_port):
    fuzz_case(case, embedded.url, embedded_log, closed_port, AUTH)


def test_embedded_engine_serves_after_fuzzing(embedded, biased_model_dir, embedded_log, embedded_checksums):
    if not embedded_log.requests:
        pytest.skip("the fuzz test did not run")
    print(f"fuzzed the embedded engine: {embedded_log.summary()}")
    assert_generates_like_transformers(embedded, biased_model_dir, build_char_tokenizer().encode(PROMPT_TEXT))
    after = httpx.get(f"{embedded.url}/v1/weights/checksum", headers=AUTH, timeout=60).json()["checksums"]
    assert after == embedded_checksums, "the fuzzer changed the weights"
    assert embedded.info().weight_group is None


# --- vLLM's front --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def keyed() -> Iterator[None]:
    """PIPELINERL_API_KEY set to FUZZ_KEY while an engine starts and is fuzzed (its clients send it too)."""
    saved = os.environ.get("PIPELINERL_API_KEY")
    os.environ["PIPELINERL_API_KEY"] = FUZZ_KEY
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PIPELINERL_API_KEY", None)
        else:
            os.environ["PIPELINERL_API_KEY"] = saved


@pytest.fixture(scope="module")
def vllm_engine(vllm_imports, vllm_model_dir, tmp_path_factory) -> Iterator[EngineClient]:  # noqa: F811
    with keyed(), running_vllm(vllm_model_dir, tmp_path_factory.mktemp("logs") / "vllm.log", 128, 4) as client:
        yield client


@pytest.fixture(scope="module")
def vllm_log() -> FuzzLog:
    return FuzzLog()


vllm_contract = contract_schema({"/v1/weights/init_group": ["504"], "/v1/weights/checksum": ["501"]})


@needs_vllm
@vllm_contract.parametrize()
def test_vllm_front_answers_every_request_by_its_contract(case, vllm_engine, vllm_log, closed_port):
    fuzz_case(case, vllm_engine.url, vllm_log, closed_port, AUTH)


@needs_vllm
def test_vllm_front_serves_after_fuzzing(vllm_engine, vllm_model_dir, vllm_log):  # noqa: F811
    if not vllm_log.requests:
        pytest.skip("the fuzz test did not run")
    print(f"fuzzed vLLM's front: {vllm_log.summary()}")
    assert_generates_like_transformers(vllm_engine, vllm_model_dir, [5, 6, 67, 7, 8, 71])
    assert vllm_engine.info().weight_group is None
