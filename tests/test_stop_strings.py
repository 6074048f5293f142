"""Stop strings (`sampling.stop`): the engine's per-token check against the contract's definition
(`stops.stop_position`) on tokenizers whose tokens are several characters, bytes of a character, or
SentencePiece pieces; the embedded engine end to end (in process and as a real server checked by the conformance
suite, which must also fail an engine that ignores stop strings); and the requests the vLLM and SGLang fronts
send, against stand-in servers on loopback (SGLang has no CPU build; the real vLLM runs in test_vllm.py)."""

import asyncio
import json
import random
import threading
import zlib
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import torch
from conftest import running_engine

from pipelinerl.contracts.inference import Completion, GenerateRequest, SamplingParams
from pipelinerl.engines.stops import (
    StopStrings,
    StopTokenizer,
    apply_stop,
    decoder,
    find_stop,
    stop_position,
    text_through_stop,
)

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CORPUS = ["<answer>42</answer> User: hi Assistant: the answer is 7 </answer>",
          "Human: what is 2+3? Assistant: <think>2+3=5</think> <answer>5</answer>",
          "naïve café — 😀 emoji € price ü über straße"] * 20


def _fast(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>")


def bpe_tokenizer(vocab_size: int = 100):
    """Character BPE: most tokens are several characters (`</answer>`, `Assistant`, ...), decoded by joining."""
    from tokenizers import Tokenizer, decoders, models, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                                        show_progress=False))
    tok.decoder = decoders.Fuse()
    return _fast(tok)


def byte_level_tokenizer():
    """Byte-level BPE (as GPT-2, Llama 3, Qwen): some tokens are bytes of a character, decoded alone to U+FFFD."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return _fast(tok)


def metaspace_tokenizer():
    """SentencePiece-style pieces (`▁the`): decoding drops the leading space of the text's first piece."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=120, special_tokens=SPECIALS, show_progress=False))
    return _fast(tok)


def char_tokenizer():
    from pipelinerl.models.tiny import build_char_tokenizer

    return build_char_tokenizer()


TOKENIZERS = {"bpe": bpe_tokenizer, "byte_level": byte_level_tokenizer, "metaspace": metaspace_tokenizer,
              "char": char_tokenizer}


def engine_cut(tokenizer, ids: Sequence[int], stops: Sequence[str]) -> int | None:
    """Where the engine's per-token check stops `ids`: fed one token at a time, as the engine thread does."""
    check = StopStrings(stops, StopTokenizer(tokenizer))
    watch = check.watch()
    tokens: list[int] = []
    for i, t in enumerate(ids):
        tokens.append(t)
        if check.hit(tokens, watch):
            return i
    return None


def random_case(rng: random.Random, tokenizer) -> tuple[list[int], list[str]]:
    """Random token ids (with special tokens, sometimes in a long run a stop string spans) and stop strings
    taken from their text (ending anywhere, also inside tokens), sometimes with one that is not there."""
    vocab, special = len(tokenizer), tokenizer.all_special_ids
    n = rng.randint(1, 220)
    ids = [rng.choice(special) if rng.random() < 0.05 else rng.randrange(4, vocab) for _ in range(n)]
    if rng.random() < 0.3:
        at = rng.randrange(n)
        ids[at:at] = [tokenizer.eos_token_id] * rng.randint(1, 150)
    text = decoder(tokenizer)(ids)
    stops = []
    for _ in range(rng.randint(1, 3)):
        if text and rng.random() < 0.85:
            end = rng.randint(1, len(text))
            stops.append(text[max(0, end - rng.choice([1, 2, 3, 5, 8, 20])):end])
        else:
            stops.append("".join(rng.choice("xyz<>/") for _ in range(rng.randint(1, 12))))
    return ids, stops


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_engine_check_equals_the_definition(name):
    """The windowed per-token check stops at exactly the token the definition names (a whole-prefix decode per
    token), over random outputs long enough that the window slides, with special tokens inside it."""
    tokenizer = TOKENIZERS[name]()
    rng = random.Random(zlib.crc32(name.encode()))
    stopped = inside = slid = 0
    for _ in range(150):
        ids, stops = random_case(rng, tokenizer)
        want = stop_position(tokenizer, ids, stops)
        assert engine_cut(tokenizer, ids, stops) == want, (ids, stops)
        if not any("\ufffd" in s for s in stops):  # a replacement character comes and goes: not monotone
            assert find_stop(tokenizer, ids, stops) == want, (ids, stops)
        if want is not None:
            stopped += 1
            decode = decoder(tokenizer)
            text = decode(ids[:want + 1])
            inside += not any(text.endswith(s) for s in stops)  # the stop string ended inside the last token
            slid += want + 1 > 4 * max(map(len, stops)) + 40  # well past the first windows
    assert stopped > 60 and slid > 10
    if name != "char":
        assert inside > 10


def test_a_stop_string_is_matched_across_skipped_special_tokens_and_never_in_the_prompt():
    tokenizer = bpe_tokenizer()
    ids = tokenizer.encode("<answer>42</answer>")
    decode = decoder(tokenizer)
    split = next(i for i in range(1, len(ids)) if "</" in decode(ids[i:]) and "</" not in decode(ids[:i]))
    eos = tokenizer.eos_token_id
    spread = ids[:split] + [eos] * 300 + ids[split:]  # special tokens decode to nothing: the text is unchanged
    assert engine_cut(tokenizer, spread, ["</answer>"]) == stop_position(tokenizer, spread, ["</answer>"])
    assert engine_cut(tokenizer, spread, ["</answer>"]) == len(spread) - 1 - (len(ids) - 1 - stop_position(
        tokenizer, ids, ["</answer>"]))
    # only generated text counts: a prompt holding the stop string does not stop anything
    assert engine_cut(tokenizer, tokenizer.encode(" 7"), ["</answer>"]) is None


def test_completions_text_ends_at_the_stop_string_and_front_enforcement():
    assert text_through_stop("x = 4</answer> User:", ["User:", "</answer>"]) == "x = 4</answer>"
    assert text_through_stop("no stop here", ["</answer>"]) == "no stop here"
    tokenizer = bpe_tokenizer()
    ids = tokenizer.encode("<answer>42</answer> User: hi")
    cut = stop_position(tokenizer, ids, ["</answer>"])
    assert cut is not None and cut < len(ids) - 1

    def completion(n: int, finish: str) -> Completion:
        return Completion(token_ids=ids[:n], logprobs=[-0.5] * n, versions=[3] * n, finish_reason=finish)

    # an engine that went on past the stop string: cut back to the token that completed it
    c = apply_stop(completion(len(ids), "length"), tokenizer, ["</answer>"])
    assert (c.token_ids, c.finish_reason, len(c.logprobs), len(c.versions)) == (ids[:cut + 1], "stop", cut + 1, cut + 1)
    # one that finished with `length` at the very token that completed it (SGLang): a stop
    assert apply_stop(completion(cut + 1, "length"), tokenizer, ["</answer>"]).finish_reason == "stop"
    # one that did what the contract says, or held no stop string: unchanged
    for c in (completion(cut + 1, "stop"), completion(cut, "length"), completion(cut, "stop")):
        assert apply_stop(c, tokenizer, ["</answer>"]) == c


# --- the embedded engine ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bpe_model_dir(tmp_path_factory) -> Path:
    """The conftest's tiny model architecture with the character-BPE tokenizer (its 100 tokens, mostly several
    characters long, for the model's 100 embeddings)."""
    from pipelinerl.models.tiny import build_tiny_model

    out = build_tiny_model(tmp_path_factory.mktemp("bpe_model"), hidden_size=64, num_layers=2, initializer_range=0.2,
                           seed=1234)
    tokenizer = bpe_tokenizer(100)
    assert [tokenizer.convert_tokens_to_ids(t) for t in SPECIALS] == [0, 1, 2, 3]  # as the model's config says
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (out / f).unlink(missing_ok=True)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def bpe_engine(bpe_model_dir, tmp_path_factory):
    extra = ["--max-model-len", "256", "--transposed-weights", "none"]
    with running_engine(bpe_model_dir, tmp_path_factory.mktemp("logs"), extra=extra) as client:
        yield client


def test_embedded_engine_stops_where_the_definition_says(bpe_engine, bpe_model_dir):
    """Greedy and seeded samples (n=3) with stop strings that end inside multi-character tokens stop at the
    definition's token, keep it whole with its log-prob and version, and leave the other samples alone."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bpe_model_dir)
    decode = decoder(tokenizer)

    def generate(**kw):
        return bpe_engine.generate([5, 6, 7], max_new_tokens=60, ignore_eos=True, **kw).completions

    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 3, "n": 3}):
        free = generate(**sampling)
        stops, ended_inside = [], 0
        for c in free:  # a stop string ending after the first character of a multi-character token
            i = next(i for i in range(5, 60) if len(decode(c.token_ids[i:i + 1])) >= 2)
            head = decode(c.token_ids[:i])
            stops.append((head + decode(c.token_ids[i:i + 1]))[len(head) - 3:len(head) + 1])
        for c, out in zip(free, generate(stop=stops, **sampling)):
            cut = stop_position(tokenizer, c.token_ids, stops)
            assert cut is not None
            assert out.token_ids == c.token_ids[:cut + 1] and out.finish_reason == "stop"
            # the batch the sequence decoded in differs (samples that stopped left it): float noise only
            assert out.logprobs == pytest.approx(c.logprobs[:cut + 1], abs=1e-4) and len(out.versions) == cut + 1
            text = decode(out.token_ids)
            ended_inside += not any(text.endswith(s) for s in stops)
        assert ended_inside >= 1  # at least one stop string ended strictly inside its token
    # a stop string completed by the last allowed token is a stop; one never generated changes nothing
    c = generate(temperature=0)[0]
    stop = decode(c.token_ids[:20])[-2:]
    cut = stop_position(tokenizer, c.token_ids, [stop])
    last = bpe_engine.generate([5, 6, 7], temperature=0, max_new_tokens=cut + 1, ignore_eos=True, stop=[stop])
    assert last.completions[0].finish_reason == "stop" and last.completions[0].token_ids == c.token_ids[:cut + 1]
    assert generate(temperature=0, stop=["\x00never"])[0].token_ids == c.token_ids
    # OpenAI-style: one string; the text ends with it
    r = httpx.post(f"{bpe_engine.url}/v1/completions", json={"prompt": "User:", "max_tokens": 40, "temperature": 0})
    text = r.json()["choices"][0]["text"]
    stop = text[10:13]
    r = httpx.post(f"{bpe_engine.url}/v1/completions", json={"prompt": "User:", "max_tokens": 40, "temperature": 0,
                                                             "stop": stop, "logprobs": 1})
    choice = r.json()["choices"][0]
    assert choice["text"] == text[:text.index(stop) + len(stop)] and choice["finish_reason"] == "stop"
    assert len(choice["logprobs"]["tokens"]) == r.json()["usage"]["completion_tokens"]


@pytest.fixture
def fast_kernels(monkeypatch):
    """An in-process engine without its start-up timing of linear kernels (seconds on a busy machine)."""
    from pipelinerl.engines.embedded import linear_kernels

    monkeypatch.setattr(linear_kernels.LinearKernels, "timed",
                        classmethod(lambda cls, shapes, *args, **kwargs: cls.fixed(shapes)))


def test_engine_without_tokenizer_refuses_stop_strings(tiny_model_dir, fast_kernels):
    from transformers import AutoModelForCausalLM

    from pipelinerl.contracts.routes import ContractError
    from pipelinerl.engines.embedded.engine import EmbeddedEngine, EngineSettings

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    engine = EmbeddedEngine(model, str(tiny_model_dir), EngineSettings(max_running_seqs=2, max_model_len=64))
    loop = asyncio.new_event_loop()
    try:
        req = GenerateRequest(prompt_token_ids=[5], sampling=SamplingParams(stop=["ab"]))
        with pytest.raises(ContractError) as e:
            loop.run_until_complete(engine.generate(req))
        assert e.value.status == 400 and e.value.field == "sampling.stop"
        req = GenerateRequest(prompt_token_ids=[5], sampling=SamplingParams(max_new_tokens=3, ignore_eos=True))
        assert len(loop.run_until_complete(engine.generate(req)).completions[0].token_ids) == 3
    finally:
        engine.shutdown()
        loop.close()


def test_conformance_stop_check_passes_inside_multi_character_tokens(bpe_engine, bpe_model_dir):
    from pipelinerl.conformance import PASS, format_table, run_suite

    results = run_suite(bpe_engine.url, str(bpe_model_dir), only=["stop_strings", "bad_input"])
    assert [r.status for r in results] == [PASS, PASS], format_table(results)
    assert "inside a token" in results[0].detail, results[0].detail
    assert "/v1/completions text cut" in results[0].detail, results[0].detail


def test_conformance_stop_check_fails_an_engine_that_ignores_stop_strings(bpe_engine, bpe_model_dir):
    """A stand-in front on loopback that passes everything to the real engine but drops `sampling.stop`."""
    from pipelinerl.conformance import FAIL, format_table, run_suite

    class DropStop(BaseHTTPRequestHandler):
        def _relay(self, method: str) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0)) if method == "POST" else None
            if self.path == "/v1/generate":
                req = json.loads(body)
                req.get("sampling", {}).pop("stop", None)
                body = json.dumps(req).encode()
            r = httpx.request(method, bpe_engine.url + self.path, content=body, timeout=60,
                              headers={"content-type": "application/json"})
            self.send_response(r.status_code)
            self.send_header("content-type", r.headers.get("content-type", "application/json"))
            self.send_header("content-length", str(len(r.content)))
            self.end_headers()
            self.wfile.write(r.content)

        def do_GET(self):
            self._relay("GET")

        def do_POST(self):
            self._relay("POST")

        def log_message(self, *args):
            pass

    with serving(DropStop) as url:
        results = run_suite(url, str(bpe_model_dir), only=["stop_strings"])
    assert [r.status for r in results] == [FAIL], format_table(results)
    assert "finish 'length'" in results[0].detail


# --- the fronts of vLLM and SGLang -----------------------------------------------------------------------------


class serving:
    """A ThreadingHTTPServer with `handler` on a free loopback port, for the duration of a `with` (its URL)."""

    def __init__(self, handler):
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def stand_in(answer):
    """A handler class recording each POST body in `.bodies` and answering `answer(path, body)` (a dict)."""

    class Handler(BaseHTTPRequestHandler):
        bodies: list = []

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"null")
            Handler.bodies.append((self.path, body))
            out = json.dumps(answer(self.path, body)).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    return Handler


def generate_in_turn(backend, requests: list[GenerateRequest]) -> list:
    """Each request through a front's backend, one after the other (the stand-in answers in order); then closed."""
    async def calls():
        try:
            return [await backend.generate(req) for req in requests]
        finally:
            await backend.aclose()

    return asyncio.run(calls())


def test_sglang_front_sends_stop_strings_and_enforces_the_definition(bpe_model_dir):
    """The body the SGLang front sends (parameter names as in SGLang 0.5's sampling_params.py), and what it makes
    of SGLang's answers: SGLang ends a stop string completed by the last allowed token with `length`, and may
    run past a stop string spelled in more tokens than its own tokenization (its match window)."""
    from transformers import AutoTokenizer

    from pipelinerl.engines.common import model_facts
    from pipelinerl.engines.sglang.front import SGLangBackend, SGLangSettings

    tokenizer = AutoTokenizer.from_pretrained(bpe_model_dir)
    ids = tokenizer.encode("<answer>42</answer> User: hi")
    cut = stop_position(tokenizer, ids, ["</answer>"])

    def answer(path, body):
        n = {"a": len(ids), "b": cut + 1}[body["rid"].split("-")[0]]
        return {"meta_info": {"output_token_logprobs": [[-0.25, t, None] for t in ids[:n]],
                              "finish_reason": {"type": "length", "length": n}, "weight_version": "0"}}

    handler = stand_in(answer)
    with serving(handler) as url:
        backend = SGLangBackend(url, "m", model_facts(str(bpe_model_dir), "float32"),
                                SGLangSettings(max_model_len=256, max_running_seqs=4), tokenizer)

        requests = [GenerateRequest(prompt_token_ids=[5, 6], request_id=rid, sampling=SamplingParams(
            temperature=0, max_new_tokens=40, stop=["</answer>", "User:"], seed=7)) for rid in ("a", "b")]
        requests.append(GenerateRequest(prompt_token_ids=[5, 6], request_id="a", sampling=SamplingParams()))
        ran_past, at_last, plain = generate_in_turn(backend, requests)
    sent = [body["sampling_params"] for path, body in handler.bodies if path == "/generate"]
    assert sent[0]["stop"] == ["</answer>", "User:"] and sent[0]["no_stop_trim"] is True
    assert sent[0]["skip_special_tokens"] is True and sent[0]["sampling_seed"] == 7
    assert "stop" not in sent[2] and "no_stop_trim" not in sent[2]
    for out in (ran_past, at_last):
        c = out.completions[0]
        assert c.token_ids == ids[:cut + 1] and c.finish_reason == "stop" and len(c.logprobs) == len(c.versions)
    assert plain.completions[0].token_ids == ids and plain.completions[0].finish_reason == "length"


def test_vllm_front_sends_stop_strings_with_detokenization(bpe_model_dir):
    """vLLM refuses stop strings without `detokenize`, and trims them from the text without
    `include_stop_str_in_output` (vllm/sampling_params.py): the front asks for both only when there are some."""
    from transformers import AutoTokenizer

    from pipelinerl.engines.common import model_facts
    from pipelinerl.engines.vllm.front import FrontSettings, VLLMBackend

    tokenizer = AutoTokenizer.from_pretrained(bpe_model_dir)
    ids = tokenizer.encode("<answer>42</answer> User: hi")
    cut = stop_position(tokenizer, ids, ["</answer>"])

    def answer(path, body):
        n = cut + 1 if body["sampling_params"].get("stop") else len(ids)
        return {"choices": [{"index": 0, "token_ids": ids[:n], "finish_reason": "stop" if n < len(ids) else "length",
                             "logprobs": {"content": [{"logprob": -0.5}] * n}}]}

    handler = stand_in(answer)
    with serving(handler) as url:
        backend = VLLMBackend(url, "m", model_facts(str(bpe_model_dir), "float32"),
                              FrontSettings(max_model_len=256, max_running_seqs=4), tokenizer)

        stopped, plain = generate_in_turn(backend, [GenerateRequest(prompt_token_ids=[5], sampling=SamplingParams(
            temperature=0, max_new_tokens=40, stop=stop)) for stop in (["</answer>"], [])])
    with_stop, without = [body["sampling_params"] for _, body in handler.bodies]
    assert with_stop["stop"] == ["</answer>"] and with_stop["include_stop_str_in_output"] is True
    assert with_stop["detokenize"] is True and without["detokenize"] is False and "stop" not in without
    assert stopped.completions[0].token_ids == ids[:cut + 1] and stopped.completions[0].finish_reason == "stop"
    assert plain.completions[0].finish_reason == "length"
