"""The inference contract: the HTTP messages between the pipeline (actor, trainer) and an inference engine.

These pydantic models are the single source of the contract; `contracts/openapi.json` is generated from
them (`make openapi`) and `contracts/README.md` explains the semantics. Every request model forbids unknown
fields, so a typo is an error naming the field instead of a silently ignored option, and takes every number
and boolean as the JSON type the schema gives it (no `"5"` or `1.0` for an integer, no `0` for a boolean).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    ValidationInfo,
    field_validator,
)

CONTRACT_VERSION = "1.1"

DType = Literal["float32", "bfloat16", "float16"]
FinishReason = Literal["stop", "length", "abort"]

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
# One stop string: a non-empty string of at most MAX_STOP_STRING_CHARS characters (bounded, so that the engines'
# per-token check stays cheap)
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
NonEmptyStr = Annotated[str, Field(min_length=1)]

# Request fields take the JSON type the schema documents, not what pydantic's lax mode would coerce into it: a
# server that took `"seed": false` or `"max_new_tokens": "5"` would not match its own OpenAPI document, and a
# client's type bug would go unnoticed. Numbers also exclude NaN and infinities (Python's JSON parser reads
# `NaN` and `1e999`), which no constraint would catch (NaN compares false) and no engine can use. Integers and
# booleans: pydantic's StrictInt and StrictBool.
# A JSON number: integers too (`"temperature": 1`), never a string or a boolean, always finite.
Number = Annotated[float, Strict(), AllowInfNan(False)]
# Bounded: torch's generators take seeds below 2**64 (an engine adds the sample index to the request's seed), and
# this is the largest integer that every JSON parser, and the schema's `maximum`, carry exactly.
MAX_SEED = 2**53 - 1
# Every other integer a request carries is bounded too, so that an engine can hold it in the integer types its
# kernels use: token ids and top_k in int32 (vLLM's sampler, embedding indices), a weight version in a JSON-exact
# integer. A value past one of these is refused at the edge, before it reaches a batch it could break.
MAX_TOKEN_ID = 2**31 - 1
MAX_TOP_K = 2**31 - 1
MAX_VERSION = 2**53 - 1
MAX_PROMPT_TOKENS = 2**20
MAX_PROMPT_CHARS = 2**22  # a text prompt of /v1/completions: tokenizing more would hold up the other requests
MAX_DIM = 2**31 - 1
MAX_PARAMS = 2**20  # parameters in one update
MAX_BUCKET_BYTES = 2**40
MAX_RANKS = 2**20
MAX_NAME_CHARS = 256
TokenId = Annotated[StrictInt, Field(ge=0, le=MAX_TOKEN_ID)]
PromptText = Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]
# Temperatures this close to 0 are greedy decoding, as in vLLM (its _SAMPLING_EPS): logits divided by one overflow
# float32 (below ~1e-38 the divisor itself is subnormal and the log-probs come out NaN)
GREEDY_BELOW_TEMPERATURE = 1e-5


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- generation ---------------------------------------------------------------------------------------------


class SamplingParams(_Strict):
    """How tokens are drawn. `temperature: 0` is greedy decoding, and so is any temperature below 1e-5.

    The log-probability reported for a sampled token is log softmax(logits / temperature) at that token
    (temperature 1 when greedy), before top-k and top-p truncation: the trainer can recompute it from the
    same logits, so it serves as the behaviour policy's log-probability.

    Stop strings: generation ends at the first generated token after which the decoded text of the generated
    tokens (the prompt excluded; decoded with `skip_special_tokens=True`) contains one of `stop`. That token is
    kept (finish reason `stop`), whole: the text may run past the end of the stop string to the end of that
    token. See contracts/README.md.
    """

    temperature: Number = Field(1.0, ge=0.0, le=100.0, description="0 (or below 1e-5): greedy")
    top_p: Number = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(0, ge=0, le=MAX_TOP_K,
                             description="0 disables top-k; the vocabulary's size or more keeps every token too")
    max_new_tokens: StrictInt = Field(16, ge=1, le=1_000_000)
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=1024)
    stop: list[StopString] = Field(default_factory=list, max_length=MAX_STOP_STRINGS,
                                   description="stop strings, matched in the decoded generated text; the token "
                                               "that completes one is kept (needs an engine with a tokenizer)")
    ignore_eos: StrictBool = Field(False, description="if false, the model's EOS token ids also stop generation")
    n: StrictInt = Field(1, ge=1, le=1024, description="samples drawn for the prompt")
    seed: Annotated[StrictInt, Field(ge=0, le=MAX_SEED)] | None = Field(
        None, description="makes sampling reproducible for this request")

    @field_validator("temperature")
    @classmethod
    def _greedy_near_zero(cls, temperature: float) -> float:
        return 0.0 if temperature < GREEDY_BELOW_TEMPERATURE else temperature


class GenerateRequest(_Strict):
    prompt_token_ids: list[TokenId] = Field(min_length=1, max_length=MAX_PROMPT_TOKENS)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    request_id: str | None = Field(None, max_length=MAX_NAME_CHARS, description="for /v1/abort; generated if absent")


class Completion(_Strict):
    token_ids: list[int]
    logprobs: list[float] = Field(description="log-probability of each sampled token, see SamplingParams")
    versions: list[int] = Field(description="weight version that produced each token")
    finish_reason: FinishReason


class GenerateResponse(_Strict):
    request_id: str
    prompt_len: int
    completions: list[Completion] = Field(description="n completions, in sample order")


# --- weight updates ------------------------------------------------------------------------------------------


class InitWeightUpdateGroupRequest(_Strict):
    """Join the trainer's weight-update group. The trainer is rank 0; an engine's ranks start at rank_offset.

    The call returns when the group is formed, so the trainer sends it to every engine concurrently while it
    joins the group itself.
    """

    master_address: str = Field(min_length=1, max_length=253)  # a host name or an address
    master_port: StrictInt = Field(ge=1, le=65535)
    rank_offset: StrictInt = Field(ge=1, le=MAX_RANKS)
    world_size: StrictInt = Field(ge=2, le=MAX_RANKS + 1,
                                  description="more than rank_offset: the engine's ranks are in the group")
    backend: Literal["nccl", "gloo"] = "nccl"
    group_name: str = Field("weight_update", min_length=1, max_length=MAX_NAME_CHARS)
    # bounded: a day is ample, and not every float is a duration (a timedelta overflows past ~8.6e13 s)
    timeout_s: Number = Field(120.0, gt=0, le=86_400.0)

    @field_validator("world_size")
    @classmethod
    def _holds_the_engine(cls, world_size: int, info: ValidationInfo) -> int:
        rank_offset = info.data.get("rank_offset")
        if rank_offset is not None and rank_offset >= world_size:
            raise ValueError(f"rank_offset {rank_offset} is not a rank of a group of {world_size}")
        return world_size


class ParamSpec(_Strict):
    name: str = Field(min_length=1, max_length=1024)
    dtype: DType
    shape: list[Annotated[StrictInt, Field(ge=0, le=MAX_DIM)]] = Field(max_length=8)


class UpdateWeightsRequest(_Strict):
    """Receive new weights by broadcast from rank 0 of the group, then switch to them.

    The trainer posts this and broadcasts the tensors in `params` order at the same time (wire format:
    `pipelinerl.weight_sync`). In-flight semantics: generation goes on while the tensors arrive; the engine
    switches at a step boundary; running requests keep their KV cache and continue, and every token produced
    after the switch carries `version`. A request whose names, dtypes or shapes do not match the model is
    refused with 4xx after the broadcast is drained, leaving the weights exactly as they were.
    """

    version: StrictInt = Field(ge=0, le=MAX_VERSION)
    params: list[ParamSpec] = Field(min_length=1, max_length=MAX_PARAMS)
    group_name: str = Field("weight_update", min_length=1, max_length=MAX_NAME_CHARS)
    bucket_bytes: StrictInt = Field(0, ge=0, le=MAX_BUCKET_BYTES,
                                    description="0: one broadcast per tensor; >0: packed byte buckets")


class UpdateWeightsResponse(_Strict):
    version: int
    received_bytes: int
    receive_s: float = Field(description="seconds from the request to the last byte received")
    switch_s: float = Field(description="seconds generation was paused to switch to the new weights")


class WeightsChecksumResponse(_Strict):
    """sha256 of each parameter's bytes, so a caller can prove weights changed, or did not."""

    version: int
    checksums: dict[str, str]


class AbortRequest(_Strict):
    request_id: str | None = Field(None, max_length=MAX_NAME_CHARS,
                                   description="the request to abort; all running requests if absent")


class AbortResponse(_Strict):
    aborted: list[str]


# --- status --------------------------------------------------------------------------------------------------


class HealthResponse(_Strict):
    status: Literal["ok"] = "ok"
    contract_version: str = CONTRACT_VERSION


class InfoResponse(_Strict):
    contract_version: str = CONTRACT_VERSION
    engine: str
    model: str
    weight_version: int
    max_model_len: int
    vocab_size: int
    max_running_seqs: int
    eos_token_ids: list[int]
    weight_group: str | None = Field(None, description="the weight-update group joined, if any")


class ErrorDetail(_Strict):
    type: str
    message: str
    field: str | None = None


class ErrorResponse(_Strict):
    error: ErrorDetail


# --- OpenAI-style text completions (for standard clients and eval tools) -------------------------------------


def _one_string_a_list_or_null(schema: dict[str, Any]) -> None:
    """The schema of a list field whose validator also takes one string or null (`CompletionsRequest.stop`): the
    list's schema as one choice, its items' as another, null as the third."""
    array = {key: schema.pop(key) for key in ("type", "items", "minItems", "maxItems") if key in schema}
    schema["anyOf"] = [array["items"], array, {"type": "null"}]


class CompletionsRequest(BaseModel):
    """The subset of OpenAI's /v1/completions that the engines serve; unknown OpenAI options are ignored."""

    model: str | None = None
    prompt: PromptText | Annotated[list[PromptText], Field(min_length=1, max_length=1024)]
    max_tokens: StrictInt = Field(16, ge=1, le=1_000_000)
    temperature: Number = Field(1.0, ge=0.0, le=100.0)
    top_p: Number = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(0, ge=0, le=MAX_TOP_K)
    n: StrictInt = Field(1, ge=1, le=1024)
    seed: Annotated[StrictInt, Field(ge=0, le=MAX_SEED)] | None = None
    logprobs: Annotated[StrictInt, Field(ge=0, le=1)] | None = None
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=1024)
    stop: list[StopString] = Field(default_factory=list, max_length=MAX_STOP_STRINGS,
                                   json_schema_extra=_one_string_a_list_or_null,
                                   description="stop strings: one string or a list (OpenAI style); the text ends at "
                                               "the end of the first one generated, which it includes")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: object) -> object:
        """OpenAI clients send one stop string as a plain string, or null for none."""
        return [v] if isinstance(v, str) else [] if v is None else v


class CompletionsChoiceLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]


class CompletionsChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason
    logprobs: CompletionsChoiceLogprobs | None = None


class CompletionsUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionsResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionsChoice]
    usage: CompletionsUsage
