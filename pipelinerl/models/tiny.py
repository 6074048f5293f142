"""Tiny causal LMs built from a config, with a character-level tokenizer: for tests, benchmarks and the
laptop recipe. Nothing is downloaded."""

from __future__ import annotations

import string
from collections.abc import Iterable
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARACTERS = string.digits + string.ascii_letters + " +-*/=()<>[]{}\\.,:;!?'\"\n_^$%&|#@~`"


def build_char_tokenizer():
    """A character-level fast tokenizer: one token per character, ids 0-3 special.

    It is a byte-level BPE with no merges, whose vocabulary holds the characters under their byte-level names
    (" " is "Ġ", "\n" is "Ċ"): transformers loads the tokenizer of a Qwen2 model as its Qwen2Tokenizer, which
    rebuilds exactly that (a BPE over the saved vocabulary behind a byte-level pre-tokenizer), so the tokenizer
    the processes load splits text as this one does. A plain word-level vocabulary lost every space and newline
    that way, which arithmetic never noticed and code cannot live without."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [_byte_level_name(c) for c in dict.fromkeys(CHARACTERS)]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>")


def _byte_level_name(char: str) -> str:
    """GPT-2's byte-to-unicode name of a one-byte character: printable ones are themselves, others are shifted
    past 255 (" " -> "Ġ", "\n" -> "Ċ")."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    code = ord(char)
    if code in printable:
        return char
    return chr(256 + sorted(set(range(256)) - set(printable)).index(code))


def build_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 1024):
    """A byte-level BPE fast tokenizer trained on `texts`, split into words and punctuation runs as GPT-2 and Qwen
    split them (so `</answer>` is several tokens, "</", "answer", ">", as in Qwen's vocabulary), ids 0-3 special.
    Long prompts such as ORZ's template come out several times shorter than with the char tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>")


def build_tiny_model(out_dir: str | Path, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                     num_kv_heads: int = 2, intermediate_size: int | None = None, max_positions: int = 1024,
                     seed: int = 0, initializer_range: float = 0.02, tie_embeddings: bool = True,
                     tokenizer=None) -> Path:
    """Save a randomly initialised Qwen2-architecture model and its tokenizer (default: the char tokenizer) to
    `out_dir`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    tokenizer = tokenizer or build_char_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers,
                         num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         intermediate_size=intermediate_size or 4 * hidden_size,
                         max_position_embeddings=max_positions, initializer_range=initializer_range,
                         tie_word_embeddings=tie_embeddings, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
