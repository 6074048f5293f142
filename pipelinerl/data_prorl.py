"""`pipelinerl data prorl`: the public sources of recipes/prorl_1p5b.yaml's domains, from the Hugging Face hub into
data/prorl/ as JSONL, one row per line as the hub has it.

    deepscaler.jsonl          agentica-org/DeepScaleR-Preview-Dataset, train   math (ProRL's own math data)
    taco_train.jsonl          BAAI/TACO, train                                 code with tests
    sciq_train.jsonl          allenai/sciq, train                              STEM multiple choice (training)
    mmlu_pro_test.jsonl       TIGER-Lab/MMLU-Pro, test                         STEM multiple choice (held out)
    ifeval_input_data.jsonl   google/IFEval, train                             IFEval's 541 prompts (held out)

Rows are read with the `datasets` package where it is installed (from the dataset's parquet files), else through
the hub's dataset viewer API, which is refused for a dataset whose cells it truncates (TACO's tests are large):
the command then says to install `datasets`. Nothing here is pinned: the hub was out of reach where this project
is built, so no checksum of these files could be computed ahead. What is recorded instead is the sha256 of each
file as first written, in data/prorl/SHA256SUMS (`sha256sum -c` format): `--check` and every later fetch hold the
file to it (a file changed since is reported, not replaced), so a run's data stays the data it started with.
AIME 2024 and MATH-500, the math domain's held-out sets, come from `pipelinerl data orz`; Reasoning Gym's puzzles
and the instruction-following training prompts are generated offline.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from pipelinerl import data
from pipelinerl.data import MANIFEST, DataError, DataFile, file_hashes, hub_rows, mismatch, read_manifest, record

DEFAULT_OUT = "data/prorl"
FETCH_COMMAND = "pipelinerl data prorl"


@dataclass(frozen=True)
class HubSource:
    dest: str  # file name under the output directory
    dataset: str  # Hugging Face dataset name
    split: str

    @property
    def name(self) -> str:
        return Path(self.dest).stem

    @property
    def file(self) -> DataFile:
        """As `pipelinerl data orz`'s checks see it: a file pinned by nothing but its SHA256SUMS line."""
        return DataFile(self.dest, "")


PRORL_SOURCES: tuple[HubSource, ...] = (
    HubSource("deepscaler.jsonl", "agentica-org/DeepScaleR-Preview-Dataset", "train"),
    HubSource("taco_train.jsonl", "BAAI/TACO", "train"),
    HubSource("sciq_train.jsonl", "allenai/sciq", "train"),
    HubSource("mmlu_pro_test.jsonl", "TIGER-Lab/MMLU-Pro", "test"),
    HubSource("ifeval_input_data.jsonl", "google/IFEval", "train"),
)


def read_rows(source: HubSource) -> list[dict]:
    """The split's rows: through `datasets` where installed, else the dataset viewer (whole cells only)."""
    try:
        import datasets
    except ImportError:
        return hub_rows(source.dataset, source.split)
    return [dict(row) for row in datasets.load_dataset(source.dataset, split=source.split)]


def fetch_source(source: HubSource, out: Path, manifest: dict[str, str]) -> str:
    """Write `out/<dest>` from the hub unless it is there and matches SHA256SUMS; one line saying what was done.
    Raises DataError naming the file and what to do."""
    dest = out / source.dest
    if dest.exists():
        problem, sha256 = mismatch(source.file, dest, manifest)
        if problem is not None:
            raise DataError(f"{problem}: the file changed since it was fetched. Delete it (and its line in "
                            f"{MANIFEST}) to fetch it again, or put the original back")
        if source.dest not in manifest:  # put there by hand: taken as it is, and recorded from now on
            record(out, source.dest, sha256)
            return f"ok       {source.dest} (already there; its sha256 is now recorded in {MANIFEST})"
        return f"ok       {source.dest} (already there, matches {MANIFEST})"
    try:
        rows = read_rows(source)
    except Exception as e:  # no hub, no such dataset, a network error mid-way, truncated cells: all "not now"
        raise DataError(f"{source.dest}: could not read {source.dataset} ({source.split}) from the Hugging Face "
                        f"hub: {type(e).__name__}: {str(e)[:300]}") from None
    if not rows:
        raise DataError(f"{source.dest}: {source.dataset} ({source.split}) has no rows")
    out.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(f".{dest.name}.part")
    try:
        with open(part, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)
    sha256, _ = file_hashes(dest)
    record(out, source.dest, sha256)
    manifest[source.dest] = sha256
    return f"fetched  {source.dest} ({len(rows):,} rows of {source.dataset}, sha256 {sha256[:12]}... recorded)"


def check(out: Path, sources: tuple[HubSource, ...] = PRORL_SOURCES) -> tuple[list[str], bool]:
    """(one line per file, whether every one is there and matches SHA256SUMS), fetching nothing."""
    return data.check(out, [s.file for s in sources], aime2025=False)


def missing_data_hint(path: str) -> str | None:
    """The command that makes `path` when it is one of this command's files (data/prorl/taco_train.jsonl, or
    the same name under another directory given as --out); None for any other path."""
    p = Path(path)
    if p.name not in {s.dest for s in PRORL_SOURCES}:
        return None
    command = FETCH_COMMAND if p.parent == Path(DEFAULT_OUT) else f"{FETCH_COMMAND} --out {p.parent}"
    return f"fetch it with `{command}` (needs the Hugging Face hub)"


def main(out: Path, only: set[str], check_only: bool) -> int:
    sources = tuple(s for s in PRORL_SOURCES if not only or s.name in only)
    if check_only:
        return data.report_check(*check(out, sources), out, FETCH_COMMAND, DEFAULT_OUT)
    manifest = read_manifest(out)
    failed = 0
    for source in sources:  # one source out of reach does not stop the others
        try:
            print(fetch_source(source, out, manifest), flush=True)
        except DataError as e:
            failed += 1
            print(f"{FETCH_COMMAND}: {e}", file=sys.stderr)
    if failed:
        print(f"{FETCH_COMMAND}: {failed} of {len(sources)} file(s) not fetched; run it again where the Hugging Face "
              "hub is reachable (with `pip install datasets` for datasets whose cells the hub's viewer truncates)",
              file=sys.stderr)
        return 1
    print(f"data in {out}")
    return 0
