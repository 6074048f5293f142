"""File streams: whole records only, corrupt lines skipped and counted, readers resume from saved positions."""

import multiprocessing as mp

from pipelinerl.config import StreamsConfig
from pipelinerl.streams import (
    StreamReader,
    StreamWriter,
    encode_record,
    load_position,
    open_reader,
    open_writer,
    reset_stream,
    save_position,
)


def test_records_from_several_writers_arrive_whole(tmp_path):
    with StreamWriter(tmp_path, "a") as a, StreamWriter(tmp_path, "b") as b:
        a.write({"i": 1})
        b.write_many([{"i": 2}, {"i": 3}])
        reader = StreamReader(tmp_path)
        assert sorted(r["i"] for r in reader.read()) == [1, 2, 3]
        assert reader.read() == []
        a.write({"i": 4})
        assert reader.read() == [{"i": 4}]


def test_corrupt_and_torn_lines_are_skipped_and_counted(tmp_path):
    path = tmp_path / "w.jsonl"
    good = encode_record({"ok": 1})
    flipped = bytearray(encode_record({"ok": 2}))
    flipped[-3] ^= 0x01  # a flipped bit inside the JSON
    torn = encode_record({"ok": 3})[:7]  # a writer died mid-record; the next record follows on the same line
    path.write_bytes(good + bytes(flipped) + torn + encode_record({"ok": 4}) + b"garbage\n" + good)
    reader = StreamReader(tmp_path)
    assert reader.read() == [{"ok": 1}, {"ok": 1}]
    assert reader.corrupt == 3


def test_a_line_being_appended_waits_for_its_newline(tmp_path):
    path = tmp_path / "w.jsonl"
    record = encode_record({"x": 1})
    path.write_bytes(record[:5])
    reader = StreamReader(tmp_path)
    assert reader.read() == [] and reader.corrupt == 0
    with open(path, "ab") as f:
        f.write(record[5:])
    assert reader.read() == [{"x": 1}]


def test_reader_resumes_from_saved_position(tmp_path):
    stream = tmp_path / "s"
    with StreamWriter(stream, "w") as w:
        w.write_many([{"i": i} for i in range(5)])
        reader = StreamReader(stream)
        assert len(reader.read()) == 5
        save_position(reader, tmp_path / "pos.json")
        w.write_many([{"i": i} for i in range(5, 8)])
    resumed = StreamReader(stream, load_position(tmp_path / "pos.json"))
    assert [r["i"] for r in resumed.read()] == [5, 6, 7]
    assert load_position(tmp_path / "missing.json") == {}


def _write_from_child(stream, n):
    with StreamWriter(stream, "child") as w:
        for i in range(n):
            w.write({"i": i})


def test_records_cross_processes(tmp_path):
    p = mp.get_context("spawn").Process(target=_write_from_child, args=(str(tmp_path), 50))
    p.start()
    from conftest import records_from_child  # here, not at the top: the spawned child imports this module

    got = [r["i"] for r in records_from_child(StreamReader(tmp_path), p, 50)]
    p.join()
    assert p.exitcode == 0 and got == list(range(50))


def test_the_default_backend_is_files_under_the_run_dir(tmp_path):
    cfg = StreamsConfig()
    assert cfg.backend == "files"
    with open_writer(cfg, tmp_path, "samples", "actor") as w:
        assert isinstance(w, StreamWriter)
        w.write({"i": 1})
    assert (tmp_path / "streams" / "samples" / "actor.jsonl").exists()  # the layout runs already have
    reader = open_reader(cfg, tmp_path, "samples")
    assert isinstance(reader, StreamReader) and reader.read() == [{"i": 1}]
    resumed = open_reader(cfg, tmp_path, "samples", reader.position)
    assert resumed.read() == []
    reset_stream(cfg, tmp_path, "samples")
    assert not (tmp_path / "streams" / "samples").exists()
    reset_stream(cfg, tmp_path, "samples")  # resetting a stream that is not there is fine
