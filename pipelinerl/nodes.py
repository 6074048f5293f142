"""How the launchers of a multi-node run find each other: a key-value store that node 0 hosts at
MASTER_ADDR:MASTER_PORT (torch.distributed's TCPStore, so nothing beyond torch is needed on the nodes).

    node 0                                   node r > 0
    prepares the model, sets model_ready ->  waits for model_ready, starts its engines
    waits for engines/r                  <-  publishes its engines' URLs once they are healthy
    runs trainer + actor on all engines      watches its engines and the store
    sets finished=ok|failed              ->  stops its engines, acknowledges, exits 0 (ok) or 1
    (a node r whose engine dies sets failed, which stops node 0 with the cause)
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import timedelta

from pipelinerl.placement import NodeEnv


class NodeLost(RuntimeError):
    """Node 0's store stopped answering: node 0 is gone."""


class NodeRendezvous:
    def __init__(self, node: NodeEnv, timeout_s: float = 600.0):
        from torch.distributed import TCPStore

        self.node = node
        self.timeout_s = timeout_s
        try:
            self.store = TCPStore(node.master_addr, node.master_port, node.world_size, node.rank == 0,
                                  timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        except (RuntimeError, OSError) as e:
            what = "listen on" if node.rank == 0 else "reach node 0 at"
            raise NodeLost(f"node {node.rank}: cannot {what} {node.master_addr}:{node.master_port} "
                           f"(MASTER_ADDR/MASTER_PORT): {e}") from e

    # --- small typed wrappers over the store -------------------------------------------------------------------

    def _set(self, key: str, value: object) -> None:
        self.store.set(key, json.dumps(value))

    def _get(self, key: str) -> object | None:
        """The value, or None if not set yet; NodeLost when the store is gone."""
        try:
            if not self.store.check([key]):
                return None
            return json.loads(self.store.get(key))
        except (RuntimeError, OSError) as e:  # TCPStore raises RuntimeError/DistNetworkError on a lost server
            raise NodeLost(f"node 0 ({self.node.master_addr}:{self.node.master_port}) stopped answering: {e}") from e

    def _wait_for(self, key: str, what: str, check: Callable[[], None], poll_s: float = 0.2) -> object:
        deadline = time.monotonic() + self.timeout_s
        while (value := self._get(key)) is None:
            check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {self.node.rank}: no {what} after {self.timeout_s:g}s")
            time.sleep(poll_s)
        return value

    # --- the protocol --------------------------------------------------------------------------------------------

    def model_ready(self, path: str) -> None:
        self._set("model_ready", path)

    def wait_model(self, check: Callable[[], None] = lambda: None) -> str:
        return str(self._wait_for("model_ready", "model from node 0", check))

    def publish_engines(self, urls: list[str]) -> None:
        self._set(f"engines/{self.node.rank}", urls)

    def gather_engines(self, local_urls: list[str], check: Callable[[], None]) -> list[str]:
        """Node 0: every node's engine URLs in node order, its own first. `check` raises if something died."""
        def check_all() -> None:
            check()
            self.raise_if_failed()

        urls = list(local_urls)
        for rank in range(1, self.node.world_size):
            urls += list(self._wait_for(f"engines/{rank}", f"engines from node {rank}", check_all))
        return urls

    def fail(self, message: str) -> None:
        self._set("failed", {"node": self.node.rank, "message": message})

    def raise_if_failed(self) -> None:
        failure = self._get("failed")
        if failure is not None:
            raise RuntimeError(f"node {failure['node']} failed: {failure['message']}")

    def root_cause(self, local: Exception, grace_s: float = 5.0) -> Exception:
        """Node 0, after `local` stopped the run: another node's reported failure if one arrives within
        `grace_s`, else `local`. When an engine on another node dies, node 0's trainer fails its next
        broadcast at once, while that node reports the engine at its next poll: the dead engine, not the
        trainer that lost its peer, is the cause to name."""
        deadline = time.monotonic() + grace_s
        while True:
            try:
                self.raise_if_failed()
            except RuntimeError as remote:
                return RuntimeError(f"{remote}\n(then on node {self.node.rank}: {local})")
            if time.monotonic() >= deadline:
                return local
            time.sleep(0.2)

    def finish(self, ok: bool, wait_s: float = 30.0) -> None:
        """Node 0: tell every node the run is over and wait (briefly) until they heard it, so that node 0's store
        does not vanish before they read the news."""
        self._set("finished", "ok" if ok else "failed")
        deadline = time.monotonic() + wait_s
        while self.store.add("acknowledged", 0) < self.node.world_size - 1 and time.monotonic() < deadline:
            time.sleep(0.2)

    def finished(self) -> str | None:
        """Nodes r > 0: None while the run goes on, else "ok" or "failed" (acknowledged once read)."""
        status = self._get("finished")
        if status is not None:
            self.store.add("acknowledged", 1)
        return status
