"""The model's shape (layers, heads, vocabulary...), all the planner needs to know of a model: read from a local
config.json, from the shape `model.init=tiny` will build, or from the built-in table of Qwen2.5's published
configs, so that a recipe is planned without downloading anything."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelinerl.config import ConfigError, RunConfig


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool = True  # Qwen2 has biases on q, k and v (not on o)
    source: str = ""  # where the shape came from

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        return attention + mlp + 2 * h  # two RMSNorm gains

    @property
    def embedding_params(self) -> int:
        """One V x h matrix (the input embedding; the LM head is another unless tied)."""
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        heads = 1 if self.tie_word_embeddings else 2
        return heads * self.embedding_params + self.num_layers * self.layer_params + self.hidden_size

    @property
    def largest_tensor(self) -> int:
        return max(self.embedding_params, self.hidden_size * self.intermediate_size)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def _qwen25(hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int, tied: bool) -> dict[str, Any]:
    return dict(hidden_size=hidden, intermediate_size=inter, num_layers=layers, num_heads=heads, num_kv_heads=kv,
                head_dim=hidden // heads, vocab_size=vocab, tie_word_embeddings=tied)


# The published config.json of each Qwen2.5 base model on the Hugging Face hub (the -Instruct models share them)
# and of the models built on them that recipes name.
QWEN25_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-0.5B": _qwen25(896, 4864, 24, 14, 2, 151936, True),
    "Qwen/Qwen2.5-1.5B": _qwen25(1536, 8960, 28, 12, 2, 151936, True),
    "Qwen/Qwen2.5-3B": _qwen25(2048, 11008, 36, 16, 2, 151936, True),
    "Qwen/Qwen2.5-7B": _qwen25(3584, 18944, 28, 28, 4, 152064, False),
    "Qwen/Qwen2.5-14B": _qwen25(5120, 13824, 48, 40, 8, 152064, False),
    "Qwen/Qwen2.5-32B": _qwen25(5120, 27648, 64, 40, 8, 152064, False),
    "Qwen/Qwen2.5-72B": _qwen25(8192, 29568, 80, 64, 8, 152064, False),
    # DeepSeek's R1 distillations into Qwen2.5 (ProRL starts from the 1.5B): the Qwen2.5-Math shapes, the LM head
    # untied from the embedding in the published config.json
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": _qwen25(1536, 8960, 28, 12, 2, 151936, False),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": _qwen25(3584, 18944, 28, 28, 4, 152064, False),
}


def known_shape(name: str) -> ModelShape | None:
    base = name.removesuffix("-Instruct")
    if base not in QWEN25_CONFIGS:
        return None
    return ModelShape(name=name, source="built-in table of published configs", **QWEN25_CONFIGS[base])


def shape_from_hf_config(config: dict[str, Any], name: str, source: str) -> ModelShape:
    """A Hugging Face config.json's shape. Raises ConfigError naming a missing key."""
    def need(key: str) -> int:
        if key not in config:
            raise ConfigError(f"model.path: {source} has no {key!r}; a decoder-only transformer config is needed")
        return int(config[key])

    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    model_type = config.get("model_type", "")
    # transformers' PretrainedConfig ties by default; Qwen2Config overrides it to untied
    tied = bool(config.get("tie_word_embeddings", model_type != "qwen2"))
    return ModelShape(name=name, hidden_size=hidden, intermediate_size=need("intermediate_size"),
                      num_layers=need("num_hidden_layers"), num_heads=heads,
                      num_kv_heads=int(config.get("num_key_value_heads") or heads),
                      head_dim=int(config.get("head_dim") or hidden // heads), vocab_size=need("vocab_size"),
                      tie_word_embeddings=tied, qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias")),
                      source=source)


def tiny_shape(cfg: RunConfig) -> ModelShape:
    """The shape `model.init=tiny` will build (pipelinerl.models.tiny) before it exists on disk."""
    import inspect

    from pipelinerl.models import tiny

    m = cfg.model
    defaults = {k: p.default for k, p in inspect.signature(tiny.build_tiny_model).parameters.items()}
    if m.tiny_tokenizer == "bpe":
        vocab = m.tiny_vocab_size
    else:
        vocab = len(tiny.SPECIAL_TOKENS) + len(dict.fromkeys(tiny.CHARACTERS))
    h = m.tiny_hidden_size
    heads = defaults["num_heads"]
    return ModelShape(name=f"tiny ({m.path})", hidden_size=h, intermediate_size=4 * h, num_layers=m.tiny_layers,
                      num_heads=heads, num_kv_heads=defaults["num_kv_heads"], head_dim=h // heads, vocab_size=vocab,
                      tie_word_embeddings=bool(defaults["tie_embeddings"]), source="model.init=tiny")


def model_shape(cfg: RunConfig) -> ModelShape:
    """From `model.path`'s config.json when it is a local directory, the shape `model.init=tiny` will build,
    or the built-in table of published configs by name."""
    path = Path(cfg.model.path)
    config = path / "config.json"
    if config.is_file():
        try:
            data = json.loads(config.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"model.path: cannot read {config}: {e}") from None
        return shape_from_hf_config(data, str(path), str(config))
    if cfg.model.init == "tiny":
        return tiny_shape(cfg)
    shape = known_shape(cfg.model.path)
    if shape is None:
        where = "is a directory without a config.json" if path.is_dir() else "is not a local directory"
        raise ConfigError(f"model.path: {cfg.model.path!r} {where} and not a model this planner knows "
                          f"({', '.join(QWEN25_CONFIGS)}); pass a local copy of the model (or just its "
                          "config.json in a directory): model.path=/models/NAME")
    return shape
