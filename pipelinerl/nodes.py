"""How the launchers of a multi-node run find each other: a key-value store that node 0 hosts at
MASTER_ADDR:MASTER_PORT (torch.distributed's TCPStore, so nothing beyond torch is needed on the nodes).

    node 0                                   node r > 0
                                         <-  beats alive/r every second (a thread), from start to end
    prepares the model (a hub model:     ->  waits for model_ready (no deadline: node 0's store answering and the
      fetched once), sets model_ready          run's `finished` key tell it node 0 is there); fetches the model
                                               itself only if the path is not on a filesystem it shares
    waits for starting/r (no deadline:   <-  sets starting/r, starts its engines
      its heartbeat says it is alive)
    waits for engines/r, up to the       <-  publishes its engines' URLs once they are healthy (its own deadline,
      engines' start deadline + a margin       engine.start_timeout_s, stops it first, naming the engine)
    with trainer.num_nodes > 1: sets     ->  trainer nodes (r < trainer.num_nodes) start their share of the
      trainer (port, every engine URL)         trainer processes, which meet node 0's at MASTER_ADDR:port
    runs trainer + actor on all engines      watches its engines, its trainer processes and the store
    sets finished=ok|failed              ->  stops its processes, acknowledges, exits 0 (ok) or 1
    (a node r whose engine or trainer process dies sets failed, which stops node 0 with the cause; a node whose
    heartbeat stops, its launcher or the machine gone, stops node 0 naming it)
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from pipelinerl.placement import NodeEnv

HEARTBEAT_S = 1.0  # how often nodes r > 0 say they are alive
LOST_AFTER_S = 30.0  # node 0 stops the run when a node has not said so for this long
ENGINES_MARGIN_S = 120.0  # node 0 waits this much past a node's engine start deadline before giving up on it


@dataclass(frozen=True)
class ModelReady:
    """What node 0 tells the other nodes once the model is prepared."""

    path: str  # the local directory every process loads (on node 0; the same path where the nodes share it)
    name: str  # what model.path said (a hub name, fetched again by a node that does not see `path`)
    start_timeout_s: float  # the engines' start deadline, the same on every node


class NodeLost(RuntimeError):
    """A node is gone: node 0's store stopped answering (seen from nodes r > 0), or node r's heartbeat stopped
    (seen from node 0)."""


class RendezvousForged(RuntimeError):
    """A value in node 0's store is not signed with the run's key."""


class NodeRendezvous:
    """`key`: the run's secret (or a function that gives it once it exists: node 0 makes it after it hosts the
    store, and the other nodes read it from the run directory node 0 wrote it into). Every value a node sets is
    signed with it (HMAC-SHA256 over the key's name and the value), and a value whose signature does not hold is
    never acted on: the store listens on MASTER_ADDR:MASTER_PORT, which anyone on the network can reach, and its
    values say which model every engine loads and where the trainer sends the weights. (The heartbeat and
    acknowledgement counters are not signed: one who forges them can only delay the notice of a lost node.)"""

    def __init__(self, node: NodeEnv, timeout_s: float = 600.0, key: str | Callable[[], str] | None = None):
        from torch.distributed import TCPStore

        if key is None:
            raise ValueError("a NodeRendezvous needs the run's key (PIPELINERL_API_KEY or RUN_DIR/api_key)")
        self._key = key
        self.node = node
        self.timeout_s = timeout_s
        try:
            self.store = TCPStore(node.master_addr, node.master_port, node.world_size, node.rank == 0,
                                  timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        except (RuntimeError, OSError) as e:
            what = "listen on" if node.rank == 0 else "reach node 0 at"
            raise NodeLost(f"node {node.rank}: cannot {what} {node.master_addr}:{node.master_port} "
                           f"(MASTER_ADDR/MASTER_PORT): {e}") from e
        self._beats: dict[int, tuple[int, float]] = {}  # node 0: rank -> (heartbeat count, when it last changed)
        self._lost: set[int] = set()  # node 0: nodes found gone (not waited for at the end)
        self._heartbeat_stop: threading.Event | None = None

    # --- small typed wrappers over the store -------------------------------------------------------------------

    def _secret(self) -> bytes:
        key = self._key() if callable(self._key) else self._key
        return key.encode()

    def _mac(self, key: str, payload: str) -> str:
        return hmac.new(self._secret(), f"{key}\0{payload}".encode(), hashlib.sha256).hexdigest()

    def _set(self, key: str, value: object) -> None:
        payload = json.dumps(value)
        self.store.set(key, json.dumps({"value": payload, "mac": self._mac(key, payload)}))

    def _get(self, key: str) -> object | None:
        """The value, or None if not set yet; NodeLost when the store is gone; RendezvousForged when the value is
        not signed with the run's key."""
        try:
            if not self.store.check([key]):
                return None
            raw = self.store.get(key)
        except (RuntimeError, OSError) as e:  # TCPStore raises RuntimeError/DistNetworkError on a lost server
            raise NodeLost(f"node 0 ({self.node.master_addr}:{self.node.master_port}) stopped answering: {e}") from e
        try:
            signed = json.loads(raw)
            payload, mac = signed["value"], signed["mac"]
            ok = isinstance(payload, str) and isinstance(mac, str) and hmac.compare_digest(mac, self._mac(key, payload))
        except (ValueError, TypeError, KeyError):
            ok = False
        if not ok:
            raise RendezvousForged(
                f"node {self.node.rank}: the value of {key!r} in node 0's store at {self.node.master_addr}:"
                f"{self.node.master_port} is not signed with this run's key: another process reached that port, or "
                "the nodes have different keys (set the same PIPELINERL_API_KEY on every node, or share RUN_DIR, "
                "where node 0 writes api_key); the run stops rather than act on it")
        return json.loads(payload)

    def _wait_for(self, key: str, what: str, check: Callable[[], None], timeout_s: float | None,
                  poll_s: float = 0.2) -> object:
        """The key's value once set; `check` runs at every poll (it raises to give up); None: no deadline."""
        deadline = time.monotonic() + timeout_s if timeout_s is not None else float("inf")
        while (value := self._get(key)) is None:
            check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {self.node.rank}: no {what} after {timeout_s:g}s")
            time.sleep(poll_s)
        return value

    # --- the protocol --------------------------------------------------------------------------------------------

    def model_ready(self, path: str, name: str = "", start_timeout_s: float = 900.0) -> None:
        self._set("model_ready", {"path": path, "name": name, "start_timeout_s": start_timeout_s})

    def wait_model(self, check: Callable[[], None] = lambda: None) -> ModelReady:
        """Nodes r > 0: the model node 0 prepared. No deadline: fetching a 65 GB model takes as long as it takes,
        and a node 0 that is gone fails `_get` (its store stops answering)."""
        value = self._wait_for("model_ready", "model from node 0", check, None)
        if isinstance(value, str):  # (a launcher of the previous release)
            return ModelReady(value, "", 900.0)
        return ModelReady(str(value["path"]), str(value.get("name") or ""), float(value["start_timeout_s"]))

    def engines_starting(self) -> None:
        """Nodes r > 0: this node starts its engines now; node 0's deadline for them runs from here."""
        self._set(f"starting/{self.node.rank}", time.time())

    def publish_engines(self, urls: list[str]) -> None:
        self._set(f"engines/{self.node.rank}", urls)

    def gather_engines(self, local_urls: list[str], check: Callable[[], None],
                       start_timeout_s: float = 900.0) -> list[str]:
        """Node 0: every node's engine URLs in node order, its own first. `check` raises if something died. A node
        is waited for without a deadline until it starts its engines (while its heartbeat says it is alive), then
        up to `start_timeout_s` + ENGINES_MARGIN_S: its own launcher gives up on an engine at `start_timeout_s`
        and says why, which this margin leaves it time to report."""
        def check_all() -> None:
            check()
            self.raise_if_failed()
            self.check_nodes()

        urls = list(local_urls)
        waiting_since = time.monotonic()
        for rank in range(1, self.node.world_size):
            def joined(rank: int = rank) -> None:
                check_all()
                if self.store.add(f"alive/{rank}", 0) == 0 and time.monotonic() - waiting_since > self.timeout_s:
                    raise TimeoutError(f"node 0: node {rank} never joined the run ({self.timeout_s:g} s without a "
                                       "heartbeat): is its launcher running, with the same MASTER_ADDR/MASTER_PORT?")

            self._wait_for(f"starting/{rank}", f"engine start from node {rank}", joined, None)
            urls += list(self._wait_for(f"engines/{rank}", f"engines from node {rank}", check_all,
                                        start_timeout_s + ENGINES_MARGIN_S))
        return urls

    def start_trainer(self, port: int, engine_urls: list[str]) -> None:
        """Node 0, with trainer.num_nodes > 1: the trainer nodes may start their trainer processes, which meet node
        0's at MASTER_ADDR:`port` and are given every engine's URL."""
        self._set("trainer", {"port": port, "engines": engine_urls})

    def wait_trainer(self, check: Callable[[], None]) -> tuple[int, list[str]]:
        """Trainer nodes r > 0: (port, engine URLs) once node 0 starts the trainer. No deadline of its own: node 0
        sets it when every node's engines are up, and `check` raises when the run is over or node 0 is gone."""
        value = self._wait_for("trainer", "trainer start from node 0", check, None)
        return int(value["port"]), [str(u) for u in value["engines"]]

    # --- liveness ------------------------------------------------------------------------------------------------

    def start_heartbeat(self, interval_s: float = HEARTBEAT_S) -> None:
        """Nodes r > 0: count `alive/r` up every `interval_s` on a thread of its own (with a store connection of its
        own, as a TCPStore client is not shared between threads), so that node 0 learns of a node that is gone
        even while its launcher is busy (starting engines) or when nothing is left to report it."""
        from torch.distributed import TCPStore

        node = self.node
        key, stop = f"alive/{node.rank}", threading.Event()
        try:
            store = TCPStore(node.master_addr, node.master_port, node.world_size, False,
                             timeout=timedelta(seconds=self.timeout_s), wait_for_workers=False)
            store.add(key, 1)
        except (RuntimeError, OSError) as e:
            raise NodeLost(f"node {node.rank}: cannot reach node 0 at {node.master_addr}:{node.master_port} "
                           f"(MASTER_ADDR/MASTER_PORT): {e}") from e

        def beat() -> None:
            while not stop.wait(interval_s):
                try:
                    store.add(key, 1)
                except (RuntimeError, OSError):  # node 0 is gone: the launcher's own polling says so
                    return

        threading.Thread(target=beat, name="pipelinerl-heartbeat", daemon=True).start()
        self._heartbeat_stop = stop

    def stop_heartbeat(self) -> None:
        if self._heartbeat_stop is not None:
            self._heartbeat_stop.set()

    def check_nodes(self, lost_after_s: float = LOST_AFTER_S) -> None:
        """Node 0: raise NodeLost naming a node whose heartbeat has not moved for `lost_after_s` (counted from the
        last change this node 0 saw; a node that never beat is not checked: waiting for it times out instead)."""
        now = time.monotonic()
        for rank in range(1, self.node.world_size):
            try:
                count = self.store.add(f"alive/{rank}", 0)
            except (RuntimeError, OSError) as e:
                raise NodeLost(f"node 0's own store stopped answering: {e}") from e
            seen = self._beats.get(rank)
            if seen is None or seen[0] != count:
                self._beats[rank] = (count, now)
            elif count > 0 and now - seen[1] >= lost_after_s:
                self._lost.add(rank)
                raise NodeLost(f"node {rank} is gone: its launcher has not been heard from for {now - seen[1]:.0f} s "
                               "(the machine, its network or the launcher died; its log says more, if it has one)")

    def fail(self, message: str) -> None:
        self._set("failed", {"node": self.node.rank, "message": message})

    def raise_if_failed(self) -> None:
        failure = self._get("failed")
        if failure is not None:
            raise RuntimeError(f"node {failure['node']} failed: {failure['message']}")

    def root_cause(self, local: Exception, grace_s: float = 5.0, silent_s: float = 3.0) -> Exception:
        """Node 0, after `local` stopped the run: another node's reported failure if one arrives within
        `grace_s`, or a node whose heartbeat has been silent for `silent_s` (three beats missed; short enough to be
        seen within the grace however late the loss was noticed), else `local`. When an engine or a trainer
        process on another node dies (or the node itself), node 0's trainer fails its next collective or broadcast
        at once, while that node reports at its next poll (or never): the dead process or node, not the trainer
        that lost its peer, is the cause to name."""
        deadline = time.monotonic() + grace_s
        while True:
            try:
                self.raise_if_failed()
                self.check_nodes(lost_after_s=silent_s)
            except RuntimeError as remote:
                return RuntimeError(f"{remote}\n(then on node {self.node.rank}: {local})")
            if time.monotonic() >= deadline:
                return local
            time.sleep(0.2)

    def finish(self, ok: bool, wait_s: float = 30.0) -> None:
        """Node 0: tell every node the run is over and wait (briefly) until they heard it, so that node 0's store
        does not vanish before they read the news. Nodes found gone are not waited for."""
        self._set("finished", "ok" if ok else "failed")
        deadline = time.monotonic() + wait_s
        expected = self.node.world_size - 1 - len(self._lost)
        while self.store.add("acknowledged", 0) < expected and time.monotonic() < deadline:
            time.sleep(0.2)

    def finished(self) -> str | None:
        """Nodes r > 0: None while the run goes on, else "ok" or "failed" (acknowledged once read)."""
        status = self._get("finished")
        if status is not None:
            self.stop_heartbeat()  # before node 0, acknowledged, takes its store away
            self.store.add("acknowledged", 1)
        return status
