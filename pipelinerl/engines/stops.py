"""Stop strings (`SamplingParams.stop`): the contract's definition, the embedded engine's per-token check, and
what the fronts of external engines and `/v1/completions` do with finished completions.

The definition (contracts/README.md): generation ends at the first generated token after which the decoded text
of the generated tokens (the prompt excluded; `tokenizer.decode(ids, skip_special_tokens=True)`, as the actor
decodes) contains one of the stop strings. That token is kept, whole. `stop_position` is the definition written
out (quadratic: for tests and the conformance suite); `StopStrings` checks it after every token, decoding only a
window of the last few tokens; `find_stop` locates it in a finished completion.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipelinerl.contracts.inference import Completion


def decoder(tokenizer) -> Callable[[Sequence[int]], str]:
    """Token ids to text as the definition decodes them (and as the actor does)."""
    return functools.partial(tokenizer.decode, skip_special_tokens=True)


def stop_position(tokenizer, token_ids: Sequence[int], stops: Sequence[str]) -> int | None:
    """The definition: the index of the first token whose decoded prefix `token_ids[:i + 1]` contains one of
    `stops`, or None. One decode per token: the reference the engines are tested against."""
    decode = decoder(tokenizer)
    for i in range(len(token_ids)):
        text = decode(list(token_ids[:i + 1]))
        if any(s in text for s in stops):
            return i
    return None


def find_stop(tokenizer, token_ids: Sequence[int], stops: Sequence[str]) -> int | None:
    """`stop_position` of a finished completion in a few decodes: none when the whole text holds no stop string;
    the last token when the text without it holds none (an engine that stopped where it should); otherwise a
    binary search over prefixes, which takes a prefix holding a stop string to stay holding one when extended
    (true of every tokenizer whose decoding of a prefix is a prefix of the decoding, up to its last character)."""
    decode, ids = decoder(tokenizer), list(token_ids)

    def holds(k: int) -> bool:
        text = decode(ids[:k])
        return any(s in text for s in stops)

    if not ids or not holds(len(ids)):
        return None
    lo, hi = 0, len(ids)  # holds(hi), not holds(lo)
    if not holds(hi - 1):
        return hi - 1
    hi -= 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if holds(mid):
            hi = mid
        else:
            lo = mid
    return hi - 1


def apply_stop(c: Completion, tokenizer, stops: Sequence[str]) -> Completion:
    """An external engine's completion with the contract's stop-string semantics enforced: tokens past the one
    that completed a stop string are dropped, and a completion holding one ends with `stop` (engines differ:
    SGLang finishes with `length` when the stop string is completed by the last allowed token, and matches in a
    window that can be too short to see one spelled in more tokens than its own tokenization)."""
    if not stops or tokenizer is None:
        return c
    i = find_stop(tokenizer, c.token_ids, stops)
    if i is None or (i == len(c.token_ids) - 1 and c.finish_reason == "stop"):
        return c
    k = i + 1
    return Completion(token_ids=c.token_ids[:k], logprobs=c.logprobs[:k], versions=c.versions[:k],
                      finish_reason="stop")


def text_through_stop(text: str, stops: Sequence[str]) -> str:
    """`/v1/completions`: the text up to the end of the stop string that ends first in it (kept), or all of it."""
    ends = [i + len(s) for s in stops if (i := text.find(s)) >= 0]
    return text[:min(ends)] if ends else text


# --- the engine's check, after every generated token ---------------------------------------------------------

# A window that starts after the first generated token decodes its first characters differently from the whole
# text: up to 3 replacement characters for a UTF-8 character cut by the window (byte-level and byte-fallback
# tokenizers), a dropped leading space (SentencePiece's Metaspace), a kept `##` (WordPiece). Matches starting
# there are not taken; the window is kept long enough that a stop string ending in the newest text starts after.
_MARGIN = 4
# Appending a token can change the last few characters of the text decoded before it: a replacement character
# becomes the character it completes (up to 3 for a 4-byte character in byte-fallback tokens), a space before
# punctuation is cleaned up.
_CHANGED = 4
# The window's start moves in steps of this many tokens: between two moves the text decoded before the newest
# token is the last check's, so its length is known without decoding it again.
_SLIDE = 8


def _fast_decoder(tokenizer) -> Callable[[Sequence[int]], str] | None:
    """`tokenizer.decode(ids, skip_special_tokens=True)` straight from the `tokenizers` backend, where that is all
    transformers does (its own decode and _decode, no clean-up of spaces): faster on the short windows the
    engine decodes, where transformers' Python layers are most of the time."""
    try:
        from transformers import TokenizersBackend
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return None
    cls = type(tokenizer)
    if (isinstance(tokenizer, TokenizersBackend) and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is TokenizersBackend._decode and not tokenizer.clean_up_tokenization_spaces):
        backend = tokenizer._tokenizer
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return None


class StopTokenizer:
    """What the engine's check needs of a tokenizer, worked out once: its decoding, and the token ids that decode
    to nothing (special tokens skipped by `skip_special_tokens=True`)."""

    def __init__(self, tokenizer):
        self.decode = _fast_decoder(tokenizer) or decoder(tokenizer)
        candidates = set(getattr(tokenizer, "all_special_ids", []) or [])
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        candidates |= {i for i, t in added.items() if getattr(t, "special", False)}
        # only those the decoding really drops: appending one leaves the text as it was
        self.skipped = frozenset(i for i in candidates if self.decode([i]) == "")


@dataclass
class StopWatch:
    """One sequence's state for `StopStrings.hit`."""

    window: int  # tokens to decode back from the newest (adapted to the characters they hold)
    start: int = -1  # the window's first token at the last check
    length: int = 0  # characters the window decoded to at the last check


class StopStrings:
    """One request's stop strings, checked by the engine after each token of each of its sequences.

    Equals `stop_position` without decoding the whole output every step: it decodes a window of the last tokens,
    long enough that the text before the newest token holds the longest stop string clear of the window's
    first characters (which may decode differently from the whole text: _MARGIN), and searches only where a stop
    string could end in the newest token's characters. The window's length in tokens adapts to the characters
    they decode to (doubled while too short, halved while more than three times long enough), its start moves
    _SLIDE tokens at a time, so most checks are one decode of a few tokens. Tokens that decode to nothing
    (skipped special tokens) cost no decode at all.
    """

    def __init__(self, stops: Sequence[str], tok: StopTokenizer):
        self.stops = tuple(dict.fromkeys(stops))
        self.tok = tok
        self.longest = max(len(s) for s in self.stops)
        self.need = _MARGIN + _CHANGED + self.longest - 1  # characters the text before the newest token needs

    def watch(self) -> StopWatch:
        return StopWatch(window=self.longest + _SLIDE)

    def hit(self, tokens: list[int], watch: StopWatch) -> bool:
        """Whether the text of `tokens` (the newest last) holds a stop string; not checked before this token."""
        n = len(tokens)
        if tokens[-1] in self.tok.skipped:  # the text is what it was, and held none
            return False
        decode = self.tok.decode
        while True:
            start = max(0, n - watch.window) // _SLIDE * _SLIDE
            before = watch.length if start == watch.start else len(decode(tokens[start:n - 1]))
            if start == 0 or before >= self.need:
                break
            watch.window *= 2  # too few characters before the newest token: a longer window
        text = decode(tokens[start:])
        lo = max(_MARGIN if start else 0, before - _CHANGED - self.longest + 1)
        watch.start, watch.length = start, len(text)
        if before > 3 * self.need and watch.window > _SLIDE:
            watch.window = max(_SLIDE, watch.window // 2)  # more than enough: fewer tokens from the next move on
        return any(text.find(s, lo) >= 0 for s in self.stops)
