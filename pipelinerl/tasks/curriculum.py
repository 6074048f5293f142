"""A curriculum over a task's domains (`actor.curriculum`, off by default): the domain of each group the actor
starts is drawn with weights that follow the domains' pass rates, then the domain's next problem is taken.

A domain's weight is its task weight (a mix's `weight`, a Reasoning Gym generator's) times a factor of its pass
rate p, a moving average of the answers the actor generated for it (`actor.curriculum_smoothing` per group):

- "learnability": 4 p (1 - p), largest where the policy is right half the time. A group's answers then differ the
  most, so its advantages carry the most signal; a domain always solved or never solved gives GRPO none.
- "unsolved": 1 - p, fading the domains the policy has solved (ProRL's pruning of solved prompts, per domain).

No factor goes below `actor.curriculum_floor`, so no domain is starved: its pass rate goes on being measured and
it comes back if it falls. Every domain starts at p = 0.5, that is at its task weight. Within a domain, problems
come in a seeded order reshuffled every pass; retired problems (`actor.retire_solved`) are skipped, and a domain
whose problems are all retired weighs 0. The state (each domain's place, pass rate and the draws made) is kept in
the actor's state file, so a restarted actor goes on where it stopped.
"""

from __future__ import annotations

import random
from collections.abc import Collection
from typing import Any

from pipelinerl.config import CURRICULA, ActorConfig, ConfigError


def pass_rate_factor(kind: str, pass_rate: float) -> float:
    """What a domain's weight is multiplied by at `pass_rate` (before the floor)."""
    if kind == "learnability":
        return 4.0 * pass_rate * (1.0 - pass_rate)
    if kind == "unsolved":
        return 1.0 - pass_rate
    raise ValueError(f"actor.curriculum must be one of {', '.join(CURRICULA)} or null, got {kind!r}")


def curriculum_for(task: Any, problems: list[dict], cfg: ActorConfig, seed: int, state: dict | None = None
                   ) -> DomainCurriculum | None:
    """The curriculum `cfg.curriculum` asks for over `task`'s domains; None when it asks for none. ConfigError naming
    actor.curriculum where it would have no effect: a task of one domain."""
    if cfg.curriculum is None:
        return None
    domains = task.domains() if callable(getattr(task, "domains", None)) else {}
    if len(domains) < 2:
        raise ConfigError(f"actor.curriculum: task {getattr(task, 'name', type(task).__name__)!r} has "
                          f"{'one domain' if domains else 'no domains'}, so a curriculum over domains would do "
                          "nothing; use a mix (task.name: mix) or several Reasoning Gym datasets, or set it to null")
    return DomainCurriculum(problems, domains, cfg.curriculum, cfg.curriculum_floor, cfg.curriculum_smoothing, seed,
                            state)


class DomainCurriculum:
    def __init__(self, problems: list[dict], weights: dict[str, float], kind: str, floor: float = 0.1,
                 smoothing: float = 0.05, seed: int = 0, state: dict | None = None):
        pass_rate_factor(kind, 0.5)  # an unknown kind is refused now
        self.kind, self.floor, self.smoothing, self.seed = kind, floor, smoothing, seed
        self.base = dict(weights)
        self.indices = {d: [i for i, p in enumerate(problems) if p.get("domain") == d] for d in self.base}
        stray = {p.get("domain") for p in problems} - set(self.base)
        if stray:
            raise ValueError(f"problems of domains the task does not name: {sorted(map(str, stray))}")
        state = state or {}
        self.cursor = {d: int(state.get("cursors", {}).get(d, 0)) for d in self.base}
        self.pass_rate = {d: float(state.get("pass_rates", {}).get(d, 0.5)) for d in self.base}
        self.draws = int(state.get("draws", 0))
        self._orders: dict[str, tuple[int, list[int]]] = {}
        self._exhausted: tuple[int, set[str]] = (-1, set())  # (how many were retired, the domains with none left)

    def weights(self, retired: Collection[int] = ()) -> dict[str, float]:
        """Each domain's share of the next draw (summing to 1; all 0 once every problem is retired)."""
        exhausted = self.exhausted(retired)
        raw = {d: 0.0 if d in exhausted else w * max(self.floor, pass_rate_factor(self.kind, self.pass_rate[d]))
               for d, w in self.base.items()}
        total = sum(raw.values())
        return {d: w / total if total else 0.0 for d, w in raw.items()}

    def exhausted(self, retired: Collection[int]) -> set[str]:
        """The domains whose problems are all retired (or that have none), worked out again only when more problems
        were retired (the actor's retired set only grows): not on every draw, which happens once a group."""
        if self._exhausted[0] != len(retired):
            self._exhausted = (len(retired), {d for d, own in self.indices.items() if all(i in retired for i in own)})
        return self._exhausted[1]

    def take(self, retired: Collection[int] = ()) -> int | None:
        """The index (into the task's training problems) of the next problem; None once every one is retired."""
        shares = self.weights(retired)
        if not any(shares.values()):
            return None
        names = [d for d, w in shares.items() if w > 0]
        domain = random.Random(f"{self.seed}-draw-{self.draws}").choices(names, [shares[d] for d in names])[0]
        self.draws += 1
        own = self.indices[domain]
        while True:
            n = self.cursor[domain]
            self.cursor[domain] = n + 1
            index = self._order(domain, n // len(own))[n % len(own)]
            if index not in retired:
                return index

    def _order(self, domain: str, pass_number: int) -> list[int]:
        """The domain's problems in the order of its `pass_number`th pass: the same after a restart."""
        cached = self._orders.get(domain)
        if cached is None or cached[0] != pass_number:
            order = list(self.indices[domain])
            random.Random(f"{self.seed}-{domain}-{pass_number}").shuffle(order)
            self._orders[domain] = cached = (pass_number, order)
        return cached[1]

    def observe(self, domain: str, correct: int, total: int) -> None:
        """A scored group of `domain`: `correct` of its `total` answers right."""
        if domain in self.pass_rate and total > 0:
            self.pass_rate[domain] += self.smoothing * (correct / total - self.pass_rate[domain])

    def state(self) -> dict:
        return {"cursors": dict(self.cursor), "pass_rates": dict(self.pass_rate), "draws": self.draws}
