"""`pipelinerl data orz` against a real HTTP server on loopback serving files from tmp_path: downloads verified
against both kinds of pin, corrupted files rejected and removed, verified files skipped, an unreachable server
named with what to do, `--check`, and AIME 2025 converted from a local file or the hub's rows API."""

import contextlib
import functools
import hashlib
import json
import shutil
import socket
import subprocess
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from pipelinerl import data
from pipelinerl.cli import build_parser
from pipelinerl.data import DataFile, file_hashes, missing_data_hint

SHARED_EVAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "orz_eval"

TRAIN = json.dumps([[{"from": "human", "value": "What is $1+1$?"},
                     {"from": "assistant", "ground_truth": {"value": "2"}}]]).encode()
EVAL = json.dumps([{"prompt": [{"from": "user", "value": "What is $2+3$?"}], "final_answer": "5"}]).encode()


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def reply_json(self, body: dict) -> None:
        payload = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@contextlib.contextmanager
def serving(directory: Path, handler=None):
    handler = handler or functools.partial(_Quiet, directory=str(directory))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/"


def git_blob(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    args = build_parser().parse_args(["data", "orz", *argv])
    rc = args.func(args)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.fixture
def synthetic(tmp_path, monkeypatch):
    """A server root laid out like ORZ's repository, with one training file pinned by git blob id and one eval
    file pinned by sha256, in place of ORZ's six."""
    root = tmp_path / "srv"
    (root / "data" / "eval_data").mkdir(parents=True)
    (root / "data" / "train.json").write_bytes(TRAIN)
    (root / "data" / "eval_data" / "bench.json").write_bytes(EVAL)
    files = (DataFile("train.json", "data/train.json", git_blob=git_blob(TRAIN)),
             DataFile("eval/bench.json", "data/eval_data/bench.json", sha256=hashlib.sha256(EVAL).hexdigest()))
    monkeypatch.setattr(data, "ORZ_FILES", files)
    return root


def test_git_blob_id_is_the_one_git_computes(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("no git")
    path = tmp_path / "f.json"
    path.write_bytes(TRAIN + b"\n\x00binary\xff")
    expected = subprocess.run(["git", "hash-object", str(path)], capture_output=True, text=True,
                              check=True).stdout.strip()
    assert file_hashes(path) == (hashlib.sha256(path.read_bytes()).hexdigest(), expected)


def test_good_download_is_verified_and_its_sha256_recorded(synthetic, tmp_path, capsys):
    out = tmp_path / "orz"
    with serving(synthetic) as url:
        rc, stdout, stderr = run(["--out", str(out), "--base-url", url, "--no-aime2025"], capsys)
    assert rc == 0, stderr
    assert (out / "train.json").read_bytes() == TRAIN and (out / "eval" / "bench.json").read_bytes() == EVAL
    assert "fetched  train.json" in stdout and "git blob id" in stdout and "fetched  eval/bench.json" in stdout
    assert not list(out.rglob(".*.part"))
    manifest = (out / "SHA256SUMS").read_text().splitlines()
    assert sorted(manifest) == sorted([f"{hashlib.sha256(TRAIN).hexdigest()}  train.json",
                                       f"{hashlib.sha256(EVAL).hexdigest()}  eval/bench.json"])
    rc, stdout, _ = run(["--out", str(out), "--check", "--no-aime2025"], capsys)
    assert rc == 0 and stdout.count("ok ") == 2, stdout


def test_base_url_from_the_environment(synthetic, tmp_path, capsys, monkeypatch):
    out = tmp_path / "orz"
    with serving(synthetic) as url:
        monkeypatch.setenv(data.BASE_URL_ENV, url)
        rc, _, stderr = run(["--out", str(out), "--no-aime2025"], capsys)
    assert rc == 0, stderr
    assert (out / "train.json").read_bytes() == TRAIN


@pytest.mark.parametrize("which", ["train.json", "eval/bench.json"])
def test_corrupted_download_is_rejected_and_removed(synthetic, tmp_path, capsys, which):
    out = tmp_path / "orz"
    remote = synthetic / ("data/train.json" if which == "train.json" else "data/eval_data/bench.json")
    good = remote.read_bytes()
    remote.write_bytes(good.replace(b"2", b"3"))  # same size, different content
    with serving(synthetic) as url:
        rc, _, stderr = run(["--out", str(out), "--base-url", url, "--no-aime2025"], capsys)
    assert rc == 1
    assert which in stderr and "does not match" in stderr
    if which == "train.json":  # both hashes of the kind pinned are named
        assert git_blob(good) in stderr and git_blob(remote.read_bytes()) in stderr
    else:
        assert hashlib.sha256(good).hexdigest() in stderr and hashlib.sha256(remote.read_bytes()).hexdigest() in stderr
    assert not (out / which).exists() and not list(out.rglob(".*.part"))
    manifest = out / "SHA256SUMS"
    assert not manifest.exists() or f"  {which}\n" not in manifest.read_text()


def test_verified_file_already_there_is_skipped(synthetic, tmp_path, capsys):
    out = tmp_path / "orz"
    with serving(synthetic) as url:
        assert run(["--out", str(out), "--base-url", url, "--no-aime2025"], capsys)[0] == 0
    mtimes = {p: p.stat().st_mtime_ns for p in (out / "train.json", out / "eval" / "bench.json")}
    # the server is gone: a second run that tried to download anything would fail
    rc, stdout, stderr = run(["--out", str(out), "--base-url", closed_port_url(), "--no-aime2025"], capsys)
    assert rc == 0, stderr
    assert stdout.count("already there, verified") == 2
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes


def test_file_that_fails_its_pin_is_replaced_by_the_verified_download(synthetic, tmp_path, capsys):
    out = tmp_path / "orz"
    (out / "eval").mkdir(parents=True)
    (out / "train.json").write_text("[]")
    with serving(synthetic) as url:
        rc, stdout, stderr = run(["--out", str(out), "--base-url", url, "--no-aime2025"], capsys)
    assert rc == 0, stderr
    assert "train.json: git blob id" in stderr and "downloading it again" in stderr
    assert (out / "train.json").read_bytes() == TRAIN


def test_unreachable_server_is_a_clear_error(synthetic, tmp_path, capsys):
    out = tmp_path / "orz"
    url = closed_port_url()
    rc, _, stderr = run(["--out", str(out), "--base-url", url, "--no-aime2025"], capsys)
    assert rc == 1
    assert f"{url}data/train.json" in stderr  # the URL it tried
    assert "Connection refused" in stderr and "reachable" in stderr  # why
    assert "--base-url" in stderr and "--check" in stderr and str(out / "train.json") in stderr  # what to do
    assert not (out / "train.json").exists() and not list(out.rglob(".*.part"))


def test_missing_file_on_the_server_names_the_http_status(synthetic, tmp_path, capsys):
    (synthetic / "data" / "train.json").unlink()
    with serving(synthetic) as url:
        rc, _, stderr = run(["--out", str(tmp_path / "orz"), "--base-url", url, "--no-aime2025"], capsys)
    assert rc == 1 and "HTTP 404" in stderr and f"{url}data/train.json" in stderr and "--base-url" in stderr


def test_check_downloads_nothing_and_reports_missing_and_mismatched_files(synthetic, tmp_path, capsys):
    out = tmp_path / "orz"
    rc, stdout, stderr = run(["--out", str(out), "--check", "--no-aime2025"], capsys)
    assert rc == 1 and stdout.count("missing") == 2 and not out.exists()
    assert "pipelinerl data orz --out" in stderr
    with serving(synthetic) as url:
        assert run(["--out", str(out), "--base-url", url, "--no-aime2025"], capsys)[0] == 0
    (out / "eval" / "bench.json").write_bytes(EVAL + b" ")
    rc, stdout, _ = run(["--out", str(out), "--check", "--no-aime2025"], capsys)
    assert rc == 1 and "MISMATCH eval/bench.json: sha256" in stdout
    assert hashlib.sha256(EVAL).hexdigest() in stdout and hashlib.sha256(EVAL + b" ").hexdigest() in stdout
    assert "ok       train.json" in stdout


def test_check_holds_a_git_blob_pinned_file_to_its_recorded_sha256(synthetic, tmp_path, capsys):
    out = tmp_path / "orz"
    with serving(synthetic) as url:
        assert run(["--out", str(out), "--base-url", url, "--no-aime2025", "--only", "train"], capsys)[0] == 0
    manifest = out / "SHA256SUMS"
    manifest.write_text(manifest.read_text().replace(hashlib.sha256(TRAIN).hexdigest(), "0" * 64))
    rc, stdout, _ = run(["--out", str(out), "--check", "--no-aime2025", "--only", "train"], capsys)
    assert rc == 1 and "recorded in SHA256SUMS" in stdout and "0" * 64 in stdout


@pytest.mark.skipif(not (SHARED_EVAL / "aime2024.json").exists(), reason="no copy of ORZ's eval files here")
def test_orz_eval_files_pass_their_real_pins(tmp_path, capsys):
    """ORZ's own eval files, served as its repository lays them out, pass the pinned sha256s."""
    root = tmp_path / "srv" / "data" / "eval_data"
    root.mkdir(parents=True)
    for name in ("aime2024", "math500", "gpqa_diamond"):
        shutil.copy(SHARED_EVAL / f"{name}.json", root / f"{name}.json")
    out = tmp_path / "orz"
    only = ["--only", "aime2024", "--only", "math500", "--only", "gpqa_diamond"]
    with serving(tmp_path / "srv") as url:
        rc, stdout, stderr = run(["--out", str(out), "--base-url", url, *only], capsys)
    assert rc == 0, stderr
    assert stdout.count("fetched  eval/") == 3
    rc, stdout, _ = run(["--out", str(out), "--check", *only], capsys)
    assert rc == 0 and stdout.count("sha256 matches the pin") == 3
    from pipelinerl.tasks.math_data import load_file

    assert len(load_file(out / "eval" / "aime2024.json")) == 30
    assert {p["source"] for p in load_file(out / "eval" / "math500.json")} == {"math500"}


def test_aime2025_from_a_local_file_is_converted_to_orz_eval_format(synthetic, tmp_path, capsys):
    src = tmp_path / "aime25.jsonl"
    src.write_text("\n".join(json.dumps({"id": i, "problem": f"Find $x$ if $x={i}$.", "answer": str(i)})
                             for i in range(3)))
    out = tmp_path / "orz"
    with serving(synthetic) as url:
        rc, stdout, stderr = run(["--out", str(out), "--base-url", url, "--aime2025", str(src)], capsys)
    assert rc == 0, stderr
    records = json.loads((out / "eval" / "aime2025.json").read_text())
    assert records[1] == {"prompt": [{"from": "user", "value": "Find $x$ if $x=1$."}], "final_answer": "1"}
    from pipelinerl.tasks.math_data import load_file

    problems = load_file(out / "eval" / "aime2025.json")
    assert [p["answer"] for p in problems] == ["0", "1", "2"] and {p["source"] for p in problems} == {"aime2025"}
    assert "eval/aime2025.json" in (out / "SHA256SUMS").read_text()
    rc, stdout, _ = run(["--out", str(out), "--check"], capsys)
    assert rc == 0 and "ok       eval/aime2025.json (not pinned: sha256 matches SHA256SUMS)" in stdout


class _RowsAPI(_Quiet):
    """The two endpoints of the hub's dataset viewer that `hub_rows` uses; pages of at most 2 rows."""

    ROWS = [{"id": f"p{i}", "problem": f"Compute ${i}\\cdot 2$.", "answer": str(2 * i)} for i in range(5)]

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        q = {k: v[0] for k, v in parse_qs(url.query).items()}
        if url.path == "/splits" and q.get("dataset") == "org/aime":
            body = {"splits": [{"dataset": "org/aime", "config": "default", "split": "test"}]}
        elif url.path == "/rows" and q.get("dataset") == "org/aime" and q.get("split") == "test":
            start = int(q["offset"])
            rows = self.ROWS[start:start + min(2, int(q["length"]))]
            body = {"rows": [{"row_idx": start + i, "row": r} for i, r in enumerate(rows)],
                    "num_rows_total": len(self.ROWS)}
        else:
            self.send_error(404)
            return
        self.reply_json(body)


def test_hub_rows_pages_through_the_dataset_viewer_api(tmp_path):
    with serving(tmp_path, _RowsAPI) as url:
        assert data.hub_rows("org/aime", rows_url=url) == _RowsAPI.ROWS
        assert data.hub_rows("org/aime", "test", rows_url=url) == _RowsAPI.ROWS
        with pytest.raises(ValueError, match="no split 'train'"):
            data.hub_rows("org/aime", "train", rows_url=url)


def test_aime2025_from_the_hub_without_the_datasets_package(synthetic, tmp_path, capsys, monkeypatch):
    import importlib.util

    if importlib.util.find_spec("datasets") is not None:
        pytest.skip("`datasets` is installed: the hub is read through it, not the rows API")
    out = tmp_path / "orz"
    with serving(synthetic) as url, serving(tmp_path, _RowsAPI) as rows_url:
        monkeypatch.setenv(data.HF_ROWS_URL_ENV, rows_url)
        rc, stdout, stderr = run(["--out", str(out), "--base-url", url, "--aime2025", "org/aime"], capsys)
    assert rc == 0, stderr
    records = json.loads((out / "eval" / "aime2025.json").read_text())
    assert [r["final_answer"] for r in records] == ["0", "2", "4", "6", "8"]
    assert "5 problems from org/aime" in stdout


def test_unreachable_hub_carries_on_without_aime2025(synthetic, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(data.HF_ROWS_URL_ENV, closed_port_url())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # where `datasets` is installed, it fails at once too
    out = tmp_path / "orz"
    with serving(synthetic) as url:
        rc, stdout, stderr = run(["--out", str(out), "--base-url", url, "--aime2025", "org/aime"], capsys)
    assert rc == 0, stderr
    assert (out / "train.json").exists() and not (out / "eval" / "aime2025.json").exists()
    assert "could not get AIME 2025 from 'org/aime'" in stderr and "Carrying on without AIME 2025" in stderr
    assert "task.args.eval_data" in stderr
    rc, stdout, _ = run(["--out", str(out), "--check"], capsys)
    assert rc == 1 and "missing  eval/aime2025.json" in stdout


def test_missing_data_hint_names_the_command_for_orz_paths_only():
    assert missing_data_hint("data/orz/orz_math_57k_collected.json") == (
        "fetch it with `pipelinerl data orz` (or `make data-orz`)")
    assert missing_data_hint("data/orz/eval/gpqa_diamond.json") == (
        "fetch it with `pipelinerl data orz` (or `make data-orz`)")
    assert missing_data_hint("/big/disk/orz/eval/math500.json") == (
        "fetch it with `pipelinerl data orz --out /big/disk/orz`")
    aime25 = missing_data_hint("data/orz/eval/aime2025.json")
    assert aime25 is not None and "`pipelinerl data orz`" in aime25 and "Hugging Face" in aime25
    assert "task.args.eval_data" in aime25
    assert missing_data_hint("data/orz/eval/other.json") is None
    assert missing_data_hint("data/mine/aime2024.json") is None  # an eval file not laid out as ORZ's
    assert missing_data_hint("HuggingFaceH4/MATH-500") is None


def test_aime2025_from_a_missing_file_says_so_and_carries_on(synthetic, tmp_path, capsys):
    out = tmp_path / "orz"
    with serving(synthetic) as url:
        rc, _, stderr = run(["--out", str(out), "--base-url", url, "--aime2025", str(tmp_path / "nope.jsonl")],
                            capsys)
    assert rc == 0 and f"no file {tmp_path / 'nope.jsonl'}" in stderr and "Carrying on without AIME 2025" in stderr
