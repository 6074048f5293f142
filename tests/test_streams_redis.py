"""Redis streams against a real `redis-server` on loopback: whole records, several writers, corrupt entries skipped
and counted, readers resuming from saved positions, and a clear error when Redis cannot be reached."""

import multiprocessing as mp
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pipelinerl.config import StreamsConfig
from pipelinerl.procs import free_port
from pipelinerl.streams import (
    RedisStreamReader,
    StreamBackendError,
    encode_record,
    load_position,
    open_reader,
    open_writer,
    redis_prefix,
    reset_stream,
    run_stream_id,
    save_position,
    stream_key,
)

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not on PATH (apt-get install redis-server; .ci/run does)")
redis = pytest.importorskip("redis", reason="the Redis client is not installed (pip install -e '.[dev]')")


def _start_redis(port: int) -> subprocess.Popen:
    return subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait_ready(proc: subprocess.Popen, port: int, timeout_s: float = 10) -> bool:
    client = redis.Redis(port=port, socket_connect_timeout=1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            return client.ping()
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def redis_url():
    """A throwaway redis-server on a free loopback port (retried: the port may be taken between pick and bind)."""
    for _ in range(3):
        port = free_port()
        proc = _start_redis(port)
        if _wait_ready(proc, port):
            break
        proc.kill()
        out = proc.communicate()[0].decode(errors="replace")
    else:
        pytest.fail(f"redis-server did not start:\n{out[-2000:]}")
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def cfg(redis_url) -> StreamsConfig:
    return StreamsConfig(backend="redis", redis_url=redis_url)


def test_records_from_several_writers_arrive_whole(cfg, tmp_path):
    with open_writer(cfg, tmp_path, "samples", "a") as a, open_writer(cfg, tmp_path, "samples", "b") as b:
        a.write({"i": 1})
        b.write_many([{"i": 2}, {"i": 3}])
        reader = open_reader(cfg, tmp_path, "samples")
        assert isinstance(reader, RedisStreamReader)
        assert [r["i"] for r in reader.read()] == [1, 2, 3]  # one key: stream order is append order
        assert reader.read() == []
        a.write({"i": 4})
        assert reader.read() == [{"i": 4}]
        assert reader.corrupt == 0 and a.written == 2 and b.written == 2


def test_reads_span_several_round_trips(cfg, tmp_path):
    with open_writer(cfg, tmp_path, "samples", "w") as w:
        w.write_many([{"i": i} for i in range(2500)])  # more than one XRANGE batch
    assert [r["i"] for r in open_reader(cfg, tmp_path, "samples").read()] == list(range(2500))


def _write_groups(url, run_dir, writer, groups, size):
    with open_writer(StreamsConfig(backend="redis", redis_url=url), run_dir, "samples", writer) as w:
        for g in range(groups):
            w.write_many([{"w": writer, "g": g, "k": k} for k in range(size)])


def test_concurrent_writers_never_interleave_a_batch(cfg, tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_write_groups, args=(cfg.redis_url, str(tmp_path), name, 30, 8))
             for name in ("x", "y", "z")]
    for p in procs:
        p.start()
    for p in procs:
        p.join()  # no timeout of its own: spawned children start slowly under load (pytest's timeout stops a hang)
        assert p.exitcode == 0
    records = open_reader(cfg, tmp_path, "samples").read()
    assert len(records) == 3 * 30 * 8
    for start in range(0, len(records), 8):  # the trainer relies on a group arriving as one contiguous run
        batch = records[start:start + 8]
        assert len({(r["w"], r["g"]) for r in batch}) == 1 and [r["k"] for r in batch] == list(range(8))


def test_corrupt_entries_are_skipped_and_counted(cfg, tmp_path):
    key = stream_key(cfg, tmp_path, "samples")
    client = redis.Redis.from_url(cfg.redis_url)
    flipped = bytearray(encode_record({"ok": 2}))
    flipped[-3] ^= 0x01  # a flipped bit inside the JSON
    with open_writer(cfg, tmp_path, "samples", "w") as w:
        w.write({"ok": 1})
        client.xadd(key, {"r": bytes(flipped)})
        client.xadd(key, {"r": b"0badc0de {\"torn"})
        client.xadd(key, {"something": b"else"})  # no record field at all
        client.xadd(key, {"r": b"\xff\xfe not utf-8"})
        w.write({"ok": 3})
    reader = open_reader(cfg, tmp_path, "samples")
    assert reader.read() == [{"ok": 1}, {"ok": 3}]
    assert reader.corrupt == 4
    assert reader.read() == [] and reader.corrupt == 4  # the position moved past them: counted once


def test_reader_resumes_from_saved_position_after_a_restart(cfg, tmp_path):
    with open_writer(cfg, tmp_path, "samples", "w") as w:
        w.write_many([{"i": i} for i in range(5)])
        reader = open_reader(cfg, tmp_path, "samples")
        assert len(reader.read()) == 5
        save_position(reader, tmp_path / "pos.json")
        reader.close()
        w.write_many([{"i": i} for i in range(5, 8)])
    position = load_position(tmp_path / "pos.json")
    assert list(position) == [stream_key(cfg, tmp_path, "samples")]  # the last entry id of the stream
    resumed = open_reader(cfg, tmp_path, "samples", position)  # a new reader, as after a process restart
    assert [r["i"] for r in resumed.read()] == [5, 6, 7]


def _write_from_child(url, run_dir, n):
    with open_writer(StreamsConfig(backend="redis", redis_url=url), run_dir, "samples", "child") as w:
        for i in range(n):
            w.write({"i": i})


def test_records_cross_processes(cfg, tmp_path):
    p = mp.get_context("spawn").Process(target=_write_from_child, args=(cfg.redis_url, str(tmp_path), 50))
    p.start()
    from conftest import records_from_child  # here, not at the top: the spawned child imports this module

    got = [r["i"] for r in records_from_child(open_reader(cfg, tmp_path, "samples"), p, 50)]
    p.join()
    assert p.exitcode == 0 and got == list(range(50))


def test_runs_on_one_redis_do_not_mix(cfg, tmp_path):
    run_a, run_b = tmp_path / "a" / "run", tmp_path / "b" / "run"  # same directory name, different paths
    assert redis_prefix(cfg, run_a) != redis_prefix(cfg, run_b)
    assert redis_prefix(cfg, run_a).startswith("pipelinerl:run-")
    assert redis_prefix(cfg, run_a) == redis_prefix(cfg, run_a)  # stable for the life of the run dir
    with open_writer(cfg, run_a, "samples", "w") as w:
        w.write({"run": "a"})
    assert open_reader(cfg, run_b, "samples").read() == []
    shutil.rmtree(run_a)  # a run dir deleted and started afresh at the same path does not see the old samples
    assert open_reader(cfg, run_a, "samples").read() == []
    named = StreamsConfig(backend="redis", redis_url=cfg.redis_url, redis_prefix="exp1")
    assert stream_key(named, run_a, "control") == "exp1:control"


def test_processes_racing_for_the_run_id_agree(tmp_path):
    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(lambda _: run_stream_id(tmp_path), range(32)))
    assert len(set(ids)) == 1 and len(ids[0]) == 8


def test_reset_stream_deletes_only_that_stream(cfg, tmp_path):
    with open_writer(cfg, tmp_path, "control", "t") as c, open_writer(cfg, tmp_path, "samples", "a") as s:
        c.write({"kind": "done"})
        s.write({"i": 1})
    reset_stream(cfg, tmp_path, "control")
    assert open_reader(cfg, tmp_path, "control").read() == []
    assert open_reader(cfg, tmp_path, "samples").read() == [{"i": 1}]


def test_unreachable_redis_fails_naming_the_key_and_the_fix(tmp_path):
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"  # nothing listens there
    cfg = StreamsConfig(backend="redis", redis_url=url)
    for open_stream in (lambda: open_reader(cfg, tmp_path, "samples"),
                        lambda: open_writer(cfg, tmp_path, "samples", "w")):
        with pytest.raises(StreamBackendError) as err:
            open_stream()
        message = str(err.value)
        assert "streams.redis_url" in message and "redis-server" in message and "streams.backend=files" in message
        assert "hunter2" not in message  # the password is not printed


def test_redis_going_away_mid_run_is_the_same_clear_error(tmp_path):
    port = free_port()
    proc = _start_redis(port)
    assert _wait_ready(proc, port)
    cfg = StreamsConfig(backend="redis", redis_url=f"redis://127.0.0.1:{port}/0")
    writer = open_writer(cfg, tmp_path, "samples", "w")
    writer.write({"i": 1})
    proc.terminate()
    proc.wait(timeout=10)
    with pytest.raises(StreamBackendError, match="streams.redis_url"):
        writer.write({"i": 2})


# --- end to end ----------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_pipeline_runs_on_redis_streams(redis_url, tmp_path):
    from test_pipeline import launch, metrics

    run_dir = tmp_path / "run"
    cfg = StreamsConfig(backend="redis", redis_url=redis_url)
    r = launch(run_dir, "trainer.max_steps=3", "actor.max_lag=1", "streams.backend=redis",
               f"streams.redis_url={redis_url}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [row["step"] for row in metrics(run_dir)] == [1, 2, 3]
    assert not (run_dir / "streams").exists(), "nothing went to the files backend"
    samples = open_reader(cfg, run_dir, "samples").read()
    assert len(samples) >= 3 * 16
    control = open_reader(cfg, run_dir, "control").read()
    assert control[-1] == {"kind": "done", "version": 3}


def _launcher_calls(name: str) -> bool:
    return any(name in path.read_text() for path in (ROOT / "pipelinerl" / "launch").glob("*.py"))


@pytest.mark.slow
@pytest.mark.skipif(not _launcher_calls("reset_stream"),
                    reason="a rerun needs launch.py to clear the control stream on Redis too "
                           "(reset_stream(cfg.streams, run_dir, 'control')); not wired yet")
def test_rerun_on_redis_streams_resumes(redis_url, tmp_path):
    from test_pipeline import launch, metrics

    run_dir = tmp_path / "run"
    overrides = ("actor.max_lag=1", "streams.backend=redis", f"streams.redis_url={redis_url}")
    r = launch(run_dir, "trainer.max_steps=2", *overrides)
    assert r.returncode == 0, r.stderr[-3000:]
    r = launch(run_dir, "trainer.max_steps=4", *overrides)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [row["step"] for row in metrics(run_dir)] == [1, 2, 3, 4]


@pytest.mark.skipif(not _launcher_calls("check_backend"),
                    reason="launch.py does not check the stream backend before starting (check_backend); not wired yet")
def test_launcher_stops_before_starting_anything_when_redis_is_unreachable(tmp_path):
    from test_pipeline import launch

    r = launch(tmp_path / "run", "streams.backend=redis", f"streams.redis_url=redis://127.0.0.1:{free_port()}/0",
               timeout=60)
    assert r.returncode == 2
    assert "streams.redis_url" in r.stderr and "streams.backend=files" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run" / "logs").exists(), "no process was started"
