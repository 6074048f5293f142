"""`pipelinerl data prorl` against a real HTTP server on loopback standing in for the hub's dataset viewer: each
source written as JSONL with its sha256 recorded, a file changed since reported and kept, truncated cells refused,
an unreachable hub named, `--check`, and the hint a run's preflight gives for a missing data/prorl file."""

import json
import sys
from urllib.parse import parse_qs, urlsplit

import pytest
from test_data import _Quiet, closed_port_url, serving

from pipelinerl import data, data_prorl
from pipelinerl.cli import build_parser
from pipelinerl.data import missing_data_hint

ROWS = {"org/sciq": [{"question": f"What is {i}?", "correct_answer": str(i), "distractor1": "x"} for i in range(5)],
        "org/big": [{"question": "q", "tests": "{...}"}]}


class _Viewer(_Quiet):
    """/splits and /rows of the dataset viewer for two datasets; org/big's cells come back truncated."""

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        q = {k: v[0] for k, v in parse_qs(url.query).items()}
        rows = ROWS.get(q.get("dataset", ""))
        if rows is None:
            self.send_error(404)
            return
        if url.path == "/splits":
            body = {"splits": [{"dataset": q["dataset"], "config": "default", "split": "train"}]}
        else:
            start = int(q["offset"])
            page = rows[start:start + 2]
            body = {"rows": [{"row_idx": start + i, "row": r,
                              "truncated_cells": ["tests"] if q["dataset"] == "org/big" else []}
                             for i, r in enumerate(page)], "num_rows_total": len(rows)}
        self.reply_json(body)


@pytest.fixture
def sources(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as where `datasets` is not installed: the viewer is read
    two = (data_prorl.HubSource("sciq_train.jsonl", "org/sciq", "train"),
           data_prorl.HubSource("taco_train.jsonl", "org/big", "train"))
    monkeypatch.setattr(data_prorl, "PRORL_SOURCES", two)
    with serving(tmp_path, _Viewer) as url:
        monkeypatch.setenv(data.HF_ROWS_URL_ENV, url)
        yield two


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    args = build_parser().parse_args(["data", "prorl", *argv])
    rc = args.func(args)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_sources_are_written_as_jsonl_with_their_sha256_recorded(sources, tmp_path, capsys):
    out = tmp_path / "prorl"
    rc, stdout, stderr = run(["--out", str(out), "--only", "sciq_train"], capsys)
    assert rc == 0, stderr
    lines = (out / "sciq_train.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == ROWS["org/sciq"]
    assert "fetched  sciq_train.jsonl (5 rows of org/sciq" in stdout
    assert (out / "SHA256SUMS").read_text().endswith("  sciq_train.jsonl\n")
    rc, stdout, _ = run(["--out", str(out), "--only", "sciq_train"], capsys)  # there and unchanged: kept
    assert rc == 0 and "ok       sciq_train.jsonl (already there, matches SHA256SUMS)" in stdout
    # a file changed since it was fetched is reported and left alone, by a fetch and by --check
    (out / "sciq_train.jsonl").write_text(lines[0] + "\n")
    rc, _, stderr = run(["--out", str(out), "--only", "sciq_train"], capsys)
    assert rc == 1 and "the file changed since" in stderr and len((out / "sciq_train.jsonl").read_text()) < 100
    rc, stdout, _ = run(["--out", str(out), "--check", "--only", "sciq_train"], capsys)
    assert rc == 1 and "MISMATCH sciq_train.jsonl" in stdout


def test_truncated_cells_are_refused_and_the_other_sources_still_fetched(sources, tmp_path, capsys):
    out = tmp_path / "prorl"
    rc, stdout, stderr = run(["--out", str(out)], capsys)
    assert rc == 1 and (out / "sciq_train.jsonl").exists() and not (out / "taco_train.jsonl").exists()
    assert "truncates the tests cells of 'org/big'" in stderr and "pip install datasets" in stderr
    assert not list(out.glob(".*.part"))
    rc, stdout, _ = run(["--out", str(out), "--check"], capsys)
    assert rc == 1 and "missing  taco_train.jsonl" in stdout and "ok       sciq_train.jsonl" in stdout


def test_an_unreachable_hub_is_named(sources, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(data.HF_ROWS_URL_ENV, closed_port_url())
    rc, _, stderr = run(["--out", str(tmp_path / "prorl"), "--only", "sciq_train"], capsys)
    assert rc == 1 and "could not read org/sciq (train) from the Hugging Face hub" in stderr
    assert "run it again where the Hugging Face hub is reachable" in stderr


def test_the_hint_for_a_missing_prorl_file_names_the_command():
    assert missing_data_hint("data/prorl/taco_train.jsonl") == (
        "fetch it with `pipelinerl data prorl` (needs the Hugging Face hub)")
    assert missing_data_hint("/disk/p/mmlu_pro_test.jsonl") == (
        "fetch it with `pipelinerl data prorl --out /disk/p` (needs the Hugging Face hub)")
    assert missing_data_hint("data/prorl/mine.jsonl") is None


def test_every_prorl_file_the_recipe_reads_is_one_this_command_makes():
    from pathlib import Path

    from pipelinerl.config import load_config
    from pipelinerl.launch.preflight import missing_data

    root = Path(__file__).resolve().parents[1]
    problems = missing_data(load_config(root / "recipes" / "prorl_1p5b.yaml"))
    prorl = [p for p in problems if "data/prorl/" in p]
    assert len(prorl) == 5 and all("pipelinerl data prorl" in p for p in prorl), prorl
