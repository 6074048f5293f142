"""The embedded engine's counters, kept by its scheduler and weight switch, and their /metrics rendering."""

from __future__ import annotations

import time

from pipelinerl.contracts.routes import render_metrics


class Metrics:
    def __init__(self) -> None:
        self.generated_tokens = 0
        self.decode_steps = 0
        self.decode_seconds = 0.0
        self.requests_finished = 0
        self.admissions = 0  # batched prefills of newly admitted requests
        self.updates = 0
        self.updates_while_running = 0
        self.update_bytes = 0
        self.update_receive_seconds = 0.0
        self.update_switch_seconds = 0.0
        self.refused_updates = 0
        self.last_update_bytes = 0
        self.last_update_receive_seconds = 0.0
        self.last_update_switch_seconds = 0.0
        self.relayouts = 0  # updates whose weights were copied transposed before the switch
        self.relayout_seconds = 0.0
        self.started = time.monotonic()

    def render(self, running: int, waiting: int, version: int, receiver_restarts: int) -> str:
        """The Prometheus text of these counters, with the engine's gauges that are not counted here: the
        sequences running, the requests waiting, the weight version, the receiving processes replaced."""
        m = self
        rows = [
            ("running_seqs", "gauge", running, "sequences being decoded"),
            ("waiting_requests", "gauge", waiting, "requests queued for admission"),
            ("weight_version", "gauge", version, "current weight version"),
            ("generated_tokens_total", "counter", m.generated_tokens, "tokens generated"),
            ("decode_steps_total", "counter", m.decode_steps, "batched decode steps"),
            ("decode_seconds_total", "counter", m.decode_seconds, "time spent in decode steps"),
            ("tokens_per_second", "gauge", m.generated_tokens / max(m.decode_seconds, 1e-9),
             "generated tokens per second of decoding"),
            ("requests_finished_total", "counter", m.requests_finished, "requests completed"),
            ("admissions_total", "counter", m.admissions, "batches of requests admitted, each one prefill"),
            ("weight_updates_total", "counter", m.updates, "weight updates applied"),
            ("weight_updates_while_running_total", "counter", m.updates_while_running,
             "updates applied while sequences were running"),
            ("weight_updates_refused_total", "counter", m.refused_updates, "mismatched updates refused"),
            ("weight_update_bytes_total", "counter", m.update_bytes, "bytes received by updates"),
            ("weight_update_receive_seconds_total", "counter", m.update_receive_seconds, "time receiving"),
            ("weight_update_switch_seconds_total", "counter", m.update_switch_seconds,
             "decode time lost to switching weights"),
            ("last_weight_update_bytes", "gauge", m.last_update_bytes, "bytes of the last update"),
            ("last_weight_update_receive_seconds", "gauge", m.last_update_receive_seconds,
             "seconds receiving the last update"),
            ("last_weight_update_switch_seconds", "gauge", m.last_update_switch_seconds,
             "decode pause for the last update"),
            ("weight_relayouts_total", "counter", m.relayouts,
             "updates whose weights were copied transposed (for faster matmuls) before the switch"),
            ("weight_relayout_seconds_total", "counter", m.relayout_seconds,
             "time spent copying received weights transposed, on the receiving CPUs"),
            ("weight_receiver_restarts_total", "counter", receiver_restarts,
             "weight-receiving processes that died and were replaced"),
        ]
        return render_metrics(rows)
