"""The trainer's side of the conformance suite: the local copy of the served model, the weights the suite pushes
(the same ones and changed ones), and an independent float32 rescoring of the engine's tokens under them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pipelinerl.contracts.inference import Completion


class Reference:
    """The local copy of the served model: the weights the suite pushes, and an independent rescoring of the
    engine's tokens under them (transformers, float32)."""

    def __init__(self, path: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        # parameters only, deduplicated (a tied lm_head follows the embedding), in a fixed order: what a
        # trainer sends
        self.base = {k: v.detach().clone() for k, v in self.model.named_parameters()}
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self._loaded: dict[str, torch.Tensor] | None = None
        self._flip_names: list[str] | None = None

    def named(self, state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        return [(n, state[n]) for n in self.base]

    def perturbed(self, seed: int, scale: float = 0.5) -> dict[str, torch.Tensor]:
        """The base weights with Gaussian noise of `scale` standard deviations added to every matrix (vectors
        kept). It changes every layer, so the KV cache computed under it differs from the base's, but it need not
        change any greedy token: a freshly initialised model with tied embeddings repeats its input's last token
        with or without it."""
        g = torch.Generator().manual_seed(seed)
        return {k: v + scale * v.std() * torch.randn(v.shape, generator=g) if v.dim() > 1 else v.clone()
                for k, v in self.base.items()}

    def flipped(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """`state` with every output logit negated (the same hidden states, -logits), or None where this model
        has no parameters that do that. Under it every greedy token is the base's least likely one, so whatever
        the model (confident, random, repeating one token), the argmax changes at every position whose logits
        are not all equal."""
        names = self.flip_names
        return None if names is None else {k: -v if k in names else v for k, v in state.items()}

    @property
    def flip_names(self) -> list[str] | None:
        """The parameters the logits are linear in and nothing else reads: an untied head's weight and bias, or
        with a tied head (which is also the input embedding) the final norm's scale and shift. Found by running
        the model, and used only if negating them negates the logits exactly on a probe."""
        if self._flip_names is None:
            self._flip_names = self._find_flip_names() or []
        return self._flip_names or None

    @torch.no_grad()
    def _find_flip_names(self) -> list[str] | None:
        head, embedding = self.model.get_output_embeddings(), self.model.get_input_embeddings()
        if head is None or not list(head.parameters(recurse=False)):
            return None
        names = {id(p): n for n, p in self.model.named_parameters()}
        probe = torch.arange(8)[None] % self.vocab_size
        self._load(self.base)
        if getattr(head, "weight", None) is not getattr(embedding, "weight", None):
            found = [names[id(p)] for p in head.parameters(recurse=False)]
        else:  # the module whose output the head multiplies: the last one run before it with that output
            outputs: list[tuple[torch.nn.Module, Any]] = []
            head_input: list[torch.Tensor] = []
            hooks = [m.register_forward_hook(lambda m, _, out: outputs.append((m, out)))
                     for m in self.model.modules() if m is not head and list(m.parameters(recurse=False))]
            hooks.append(head.register_forward_pre_hook(lambda _, args: head_input.append(args[0])))
            try:
                self.model(probe)
            finally:
                for h in hooks:
                    h.remove()
            if not head_input:
                return None
            x = head_input[0]
            feeding = [m for m, out in outputs if isinstance(out, torch.Tensor) and out.shape == x.shape
                       and torch.equal(out, x)]
            if not feeding:
                return None
            found = [names[id(p)] for p in feeding[-1].parameters(recurse=False) if id(p) in names]
        if not found or not set(found) <= set(self.base):
            return None
        logits = self.model(probe).logits
        self._load({k: -v if k in found else v for k, v in self.base.items()})
        flipped = self.model(probe).logits
        scale = float(logits.abs().max()) + 1e-6
        return found if torch.allclose(flipped, -logits, rtol=1e-4, atol=1e-5 * scale) else None

    def changed(self, seed: int) -> list[tuple[str, dict[str, torch.Tensor]]]:
        """New weights to push, with what they are, best first: noise in every layer with the logits negated
        (the greedy tokens change, and so does the KV cache), then the logits negated alone (the body, hence the
        KV cache, kept: a fallback where the noise happens to undo the negation). A model without such
        parameters gets stronger and stronger noise, and the checks verify with this model whether it shows."""
        noisy = self.perturbed(seed)
        flipped_noisy, flipped_base = self.flipped(noisy), self.flipped(self.base)
        if flipped_noisy is not None and flipped_base is not None:
            return [("noise in every matrix and the logits negated", flipped_noisy),
                    ("the logits negated", flipped_base)]
        return [(f"noise of {s:g} standard deviations in every matrix", self.perturbed(seed, s))
                for s in (0.5, 1.0, 2.0)]

    @torch.no_grad()
    def next_logits(self, state: dict[str, torch.Tensor], prompt: Sequence[int]) -> torch.Tensor:
        """Logits of the first token generated after `prompt` ([vocab])."""
        self._load(state)
        return self.model(torch.tensor([list(prompt)])).logits[0, -1].float()

    def _load(self, state: dict[str, torch.Tensor]) -> None:
        if self._loaded is not state:
            self.model.load_state_dict(state, strict=False)
            self._loaded = state

    @torch.no_grad()
    def logits(self, state: dict[str, torch.Tensor], prompt: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """Logits that predicted each of `tokens` after `prompt` ([len(tokens), vocab])."""
        self._load(state)
        ids = torch.tensor([list(prompt) + list(tokens)])
        return self.model(ids).logits[0, len(prompt) - 1:-1].float()

    @torch.no_grad()
    def logits_switched(self, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], prompt: Sequence[int],
                        tokens: Sequence[int], switch: int) -> torch.Tensor:
        """What an in-flight switch computes: tokens[:switch] from `old`; the rest from `new`, attending to a KV
        cache of prompt + tokens[:switch - 1] computed under `old`."""
        self._load(old)
        out = self.model(torch.tensor([list(prompt) + list(tokens[:switch - 1])]), use_cache=True)
        before = out.logits[0, len(prompt) - 1:]
        self._load(new)
        after = self.model(torch.tensor([list(tokens[switch - 1:-1])]), past_key_values=out.past_key_values,
                           use_cache=True).logits[0]
        return torch.cat([before, after]).float()


def mismatch(c: Completion, logits: torch.Tensor, temperature: float, atol: float) -> str | None:
    """Why the engine's tokens and log-probs disagree with `logits`, or None.

    Log-probs must equal log softmax(logits / temperature) at the sampled token (temperature 1 when greedy)
    within `atol`; a greedy token must be the argmax (within `atol`, so that near-ties do not fail)."""
    t = temperature if temperature > 0 else 1.0
    tokens = torch.tensor(c.token_ids)
    logprobs = torch.log_softmax(logits / t, dim=-1)
    expected = logprobs.gather(1, tokens[:, None])[:, 0]
    diff = (expected - torch.tensor(c.logprobs)).abs()
    if diff.numel() and float(diff.max()) > atol:
        i = int(diff.argmax())
        return (f"token {i}: log-prob {c.logprobs[i]:.6f}, the rescoring gives {float(expected[i]):.6f} "
                f"(|diff| {float(diff[i]):.2e} > atol {atol:g})")
    if temperature == 0:
        gap = logprobs.max(dim=-1).values - expected
        if gap.numel() and float(gap.max()) > atol:
            i = int(gap.argmax())
            return (f"greedy token {i} is {c.token_ids[i]}, the rescoring's argmax is "
                    f"{int(logprobs[i].argmax())} (by {float(gap[i]):.4f} in log-prob)")
    return None
