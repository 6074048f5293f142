"""A stand-in for SGLang, for tests on machines where SGLang cannot run (it has no CPU build): it joins the
weight-update group and receives updates exactly the way SGLang 0.5.x does, written from reading SGLang's source
(0.5.4, 0.5.5.post3, 0.5.6, 0.5.12, 0.5.23): `init_custom_process_group` in sglang/srt/utils/common.py as the
model runner calls it, and the model runner's `update_weights_from_distributed`. Over gloo on CPU here, where
SGLang would use NCCL on its GPU.

Two ways to run it, each as a process of its own (as SGLang's workers are):
- `peer`: join the group hosted at each given port in turn (leaving the previous one as SGLang's
  `/destroy_weights_update_group` does), receive the tensors of `specs` in the given calls, and write sha256
  digests of what arrived to a JSON file.
- `serve`: the part of SGLang's HTTP API that pipelinerl's SGLang front uses, as a given SGLang release
  answers it, with every call the front makes recorded (`GET /standin/log`).
"""

import argparse
import hashlib
import json
import os
import socket
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

TIMEOUT = timedelta(seconds=60)  # SGLang leaves it at torch's default (30 min); shorter here so a failed test ends


def release(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split(".")[:3])


# --- SGLang's side of the weight-update group --------------------------------------------------------------------


def join_like_sglang(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                     backend: str = "gloo", timeout: timedelta = TIMEOUT) -> dist.ProcessGroup:
    """SGLang's `init_custom_process_group(backend, init_method=f"tcp://{address}:{port}", world_size, rank,
    group_name)`, which its model runner calls with rank = rank_offset + tp_rank."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    # SGLang picks the keyword by torch's version (before 0.5.12 by comparing version strings)
    options = "backend_options" if release(torch.__version__.split("+")[0]) >= (2, 6) else "pg_options"
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      **{options: None}, timeout=timeout, device_id=None)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def receive_like_sglang(pg: dist.ProcessGroup, names: list[str], dtypes: list[str],
                        shapes: list[list[int]]) -> list[tuple[str, torch.Tensor]]:
    """The model runner's `update_weights_from_distributed`: every tensor of the call allocated at once, one
    broadcast from rank 0 each, all started before any is waited for."""
    weights, handles = [], []
    for name, dtype, shape in zip(names, dtypes, shapes):
        weight = torch.empty(shape, dtype=getattr(torch, dtype))
        handles.append(dist.broadcast(weight, src=0, group=pg, async_op=True))
        weights.append((name, weight))
    for handle in handles:
        handle.wait()
    return weights


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


# --- peer --------------------------------------------------------------------------------------------------------


def peer(args: argparse.Namespace) -> int:
    if args.default_group:  # SGLang's workers have their own (tensor-parallel) default group
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    specs = json.loads(args.specs)
    calls = [int(n) for n in args.calls.split(",")]
    rounds = []
    for port in (int(p) for p in args.ports.split(",")):
        pg = join_like_sglang("127.0.0.1", port, args.rank, args.world, args.group)
        got, start = [], 0
        for n in calls:
            part = specs[start:start + n]
            start += n
            got += receive_like_sglang(pg, [s[0] for s in part], [s[1] for s in part], [s[2] for s in part])
        rounds.append({"names": [n for n, _ in got], "digests": [digest(t) for _, t in got]})
        dist.destroy_process_group(pg)  # SGLang's /destroy_weights_update_group
    with open(args.out, "w") as f:
        json.dump(rounds, f)
    return 0


# --- serve -------------------------------------------------------------------------------------------------------


def serve(args: argparse.Namespace) -> None:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    version = args.version
    new_api = release(version) >= (0, 5, 6)
    # The fields each route's request takes in this release (io_struct.py); the stand-in refuses others, so a
    # front that sends what the release does not know fails here.
    update_fields = {"names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests",
                     "weight_version"} | ({"load_format"} if new_api else set())
    group_fields = {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}
    app = FastAPI()  # (no `from __future__ import annotations` in this file: FastAPI reads the handlers' types)
    events: list[dict] = []
    state = {"paused": False, "calls": 0, "weight_version": "default"}
    groups: dict[str, dist.ProcessGroup] = {}
    lock = threading.Lock()

    def answer(success: bool, message: str) -> JSONResponse:
        return JSONResponse({"success": success, "message": message}, status_code=200 if success else 400)

    def unknown(body: dict, allowed: set[str]) -> JSONResponse | None:
        extra = sorted(set(body) - allowed)
        return JSONResponse({"detail": f"unknown fields {extra}"}, status_code=422) if extra else None

    @app.get("/health")
    def health() -> dict:
        return {}

    def server_info() -> dict:
        return {"version": version, "tp_size": args.tp_size, "dp_size": 1}

    app.get("/get_server_info")(server_info)
    if new_api:
        app.get("/server_info")(server_info)

    @app.post("/init_weights_update_group")
    async def init_group(request: Request) -> JSONResponse:
        body = await request.json()
        if (bad := unknown(body, group_fields)) is not None:
            return bad
        events.append({"route": "init_weights_update_group", **body})
        rank = body["rank_offset"] + 0  # tp_rank 0: the one worker of this stand-in
        try:
            groups[body["group_name"]] = await _in_thread(join_like_sglang, body["master_address"],
                                                          body["master_port"], rank, body["world_size"],
                                                          body["group_name"], body["backend"])
        except Exception as e:
            return answer(False, f"Failed to initialize custom process group: {e}.")
        return answer(True, "Succeeded to initialize custom process group.")

    @app.post("/destroy_weights_update_group")
    async def destroy_group(request: Request) -> JSONResponse:
        body = await request.json()
        events.append({"route": "destroy_weights_update_group", **body})
        pg = groups.pop(body.get("group_name", "weight_update_group"), None)
        if pg is None:
            return answer(False, "The group to be destroyed does not exist.")
        dist.destroy_process_group(pg)
        return answer(True, "Succeeded to destroy custom process group.")

    @app.post("/pause_generation")
    async def pause(request: Request) -> JSONResponse:
        raw = await request.body()
        body = json.loads(raw) if raw else {}
        # before 0.5.6 the route takes no body and aborts every running request; from 0.5.6 a PauseGenerationReqInput
        mode = body.get("mode", "abort") if new_api else "abort"
        if new_api and (mode not in ("abort", "retract", "in_place") or set(body) - {"mode"}):
            return JSONResponse({"detail": f"bad pause request {body}"}, status_code=422)
        events.append({"route": "pause_generation", "mode": mode, "body": body})
        state["paused"] = True
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def resume(request: Request) -> JSONResponse:
        events.append({"route": "continue_generation"})
        state["paused"] = False
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.post("/update_weights_from_distributed")
    async def update(request: Request) -> JSONResponse:
        body = await request.json()
        if (bad := unknown(body, update_fields)) is not None:
            return bad
        with lock:
            state["calls"] += 1
            call = state["calls"]
        pg = groups.get(body.get("group_name", "weight_update_group"))
        if pg is None:
            return answer(False, "Group not in the model update groups. Please call `init_weights_update_group`")
        weights = await _in_thread(receive_like_sglang, pg, body["names"], body["dtypes"], body["shapes"])
        events.append({"route": "update_weights_from_distributed", "call": call, "paused": state["paused"],
                       "names": body["names"], "dtypes": body["dtypes"], "shapes": body["shapes"],
                       "flush_cache": body.get("flush_cache", True), "weight_version": body.get("weight_version"),
                       "digests": [digest(t) for _, t in weights]})
        if call == args.fail_call:
            return answer(False, "Failed to update parameter online: injected by the stand-in. The full weights "
                                 "of the ModelRunner are partially updated. Please discard the whole weights.")
        return answer(True, "Succeeded to update parameter online.")

    @app.post("/update_weight_version")
    async def update_version(request: Request) -> JSONResponse:
        body = await request.json()
        if (bad := unknown(body, {"new_version", "abort_all_requests"})) is not None:
            return bad
        events.append({"route": "update_weight_version", "paused": state["paused"], **body})
        state["weight_version"] = body["new_version"]
        return JSONResponse({"success": True, "message": f"Weight version updated to {body['new_version']}",
                             "new_version": body["new_version"]})

    @app.get("/standin/log")
    def standin_log() -> list[dict]:
        return events

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound before the port is written, so the test connects to no one else
    with open(args.port_file + ".tmp", "w") as f:
        f.write(str(sock.getsockname()[1]))
    os.replace(args.port_file + ".tmp", args.port_file)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


async def _in_thread(fn, *args):
    import asyncio

    return await asyncio.to_thread(fn, *args)


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="mode", required=True)
    pp = sub.add_parser("peer")
    pp.add_argument("--ports", required=True, help="comma-separated: join the group hosted at each in turn")
    pp.add_argument("--rank", type=int, default=1)
    pp.add_argument("--world", type=int, default=2)
    pp.add_argument("--group", default="weight_update")
    pp.add_argument("--specs", required=True, help="JSON list of [name, dtype, shape]")
    pp.add_argument("--calls", required=True, help="comma-separated tensor counts of each update call")
    pp.add_argument("--default-group", action="store_true")
    pp.add_argument("--out", required=True)
    ps = sub.add_parser("serve")
    ps.add_argument("--version", required=True, help="the SGLang release to answer as")
    ps.add_argument("--tp-size", type=int, default=1)
    ps.add_argument("--fail-call", type=int, default=0, help="this update call (1-based) reports a failure")
    ps.add_argument("--port-file", required=True)
    args = p.parse_args()
    if args.mode == "peer":
        return peer(args)
    serve(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
