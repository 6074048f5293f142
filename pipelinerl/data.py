"""`pipelinerl data orz`: Open-Reasoner-Zero's public data, downloaded and verified into data/orz/.

Training sets (into data/orz/): orz_math_57k_collected.json, orz_math_72k_collection_extended.json and
orz_math_13k_collection_hard.json; eval sets (into data/orz/eval/): aime2024.json, math500.json and
gpqa_diamond.json. All six are raw files of ORZ's GitHub repository at one pinned commit, each checked against a
pinned checksum before it is kept:
- the eval sets by sha256, computed from the files at that commit;
- the training sets by their git blob ids at that commit (sha1 of "blob <size>\\0" + the content, what
  `git ls-tree` lists), because only the repository's tree, not these large files, was at hand where the pins were
  made, so their sha256 could not be computed. A blob id pins the content just as exactly; it is SHA-1, weaker
  than sha256 against a deliberately forged file. The sha256 of a verified download is recorded in
  data/orz/SHA256SUMS (`sha256sum -c SHA256SUMS` format), and every later run checks the file against it too.
AIME 2025 is not in ORZ's repository at that commit: it is converted to ORZ's eval format from a Hugging Face
dataset (`--aime2025`, default math-ai/aime25) where the hub is reachable; where it is not, the command says so and
carries on without it (then a recipe whose eval_data lists data/orz/eval/aime2025.json stops before it starts,
saying how to get it or to drop it).

A download goes to a temporary name beside its destination, is verified, then renamed: a file at a destination
name has passed its check. A file already there that passes is skipped. `--check` verifies without downloading.
The source is overridable (`--base-url`, or the PIPELINERL_ORZ_BASE_URL environment variable) for a mirror.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ORZ_REPO = "Open-Reasoner-Zero/Open-Reasoner-Zero"
ORZ_COMMIT = "3fdd9a07b4fb01e06005e6e74fc56690cde8a341"
DEFAULT_BASE_URL = f"https://raw.githubusercontent.com/{ORZ_REPO}/{ORZ_COMMIT}/"
BASE_URL_ENV = "PIPELINERL_ORZ_BASE_URL"
DEFAULT_OUT = "data/orz"
MANIFEST = "SHA256SUMS"
AIME2025_DEST = "eval/aime2025.json"
AIME2025_DEFAULT = "math-ai/aime25"  # 30 problems, "problem" / "answer" fields, one "test" split
# The hub's dataset viewer serves a dataset's rows as JSON: AIME 2025 without the `datasets` package
HF_ROWS_URL_ENV = "PIPELINERL_HF_ROWS_URL"
DEFAULT_HF_ROWS_URL = "https://datasets-server.huggingface.co"
FETCH_COMMAND = "pipelinerl data orz"
TIMEOUT_S = 60.0


class DataError(RuntimeError):
    """A file could not be fetched or does not match its pin; the message says which and what to do."""


@dataclass(frozen=True)
class DataFile:
    dest: str  # path under the output directory
    remote: str  # path in ORZ's repository at ORZ_COMMIT
    sha256: str = ""  # pinned sha256 of the content, or
    git_blob: str = ""  # pinned git blob id: sha1(b"blob <size>\0" + content)

    @property
    def name(self) -> str:
        return Path(self.dest).stem


# Pinned checksums. Eval sets: sha256 (the files at ORZ_COMMIT were available). Training sets: git blob ids from
# `git ls-tree -r HEAD data` at ORZ_COMMIT (their contents were not available, so no sha256 could be computed).
ORZ_FILES: tuple[DataFile, ...] = (
    DataFile("orz_math_57k_collected.json", "data/orz_math_57k_collected.json",
             git_blob="08812d4a47aadf8fa80a43f11431e6d41ba55b64"),
    DataFile("orz_math_72k_collection_extended.json", "data/orz_math_72k_collection_extended.json",
             git_blob="692af2e8184c5a5ec6e9161abd89cdf561a1cb71"),
    DataFile("orz_math_13k_collection_hard.json", "data/orz_math_13k_collection_hard.json",
             git_blob="136948e32ffd26e3988f9b9fc7be30b5626619bb"),
    DataFile("eval/aime2024.json", "data/eval_data/aime2024.json",
             sha256="ef02255e61539115f6274a0765ff10076df416db5f90d41500d472cb5184e560"),
    DataFile("eval/math500.json", "data/eval_data/math500.json",
             sha256="236bd0cc329ee3efaf045a150e6473e4f420e7e7e17051a4e77a1f2688599e63"),
    DataFile("eval/gpqa_diamond.json", "data/eval_data/gpqa_diamond.json",
             sha256="0cc1a9474957fa91ea5d6e9a901cab528576cddcd639ffb51240a77bab7678e2"),
)


# --- checksums and the manifest ------------------------------------------------------------------------------


def file_hashes(path: Path) -> tuple[str, str]:
    """(sha256, git blob id) of a file, in one pass."""
    sha256 = hashlib.sha256()
    blob = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha256.update(chunk)
            blob.update(chunk)
    return sha256.hexdigest(), blob.hexdigest()


def read_manifest(out: Path) -> dict[str, str]:
    """dest -> sha256 from `<out>/SHA256SUMS` (sha256sum's format: "<hash>  <path>")."""
    path = out / MANIFEST
    if not path.exists():
        return {}
    entries = {}
    for line in path.read_text().splitlines():
        digest, _, name = line.strip().partition("  ")
        if digest and name:
            entries[name] = digest
    return entries


def record(out: Path, dest: str, sha256: str) -> None:
    """Add or replace one manifest entry; written to a temporary name and renamed, so it is never half-written."""
    entries = read_manifest(out)
    if entries.get(dest) == sha256:
        return
    entries[dest] = sha256
    tmp = out / f".{MANIFEST}.part"
    tmp.write_text("".join(f"{digest}  {name}\n" for name, digest in sorted(entries.items())))
    os.replace(tmp, out / MANIFEST)


def mismatch(spec: DataFile, path: Path, manifest: dict[str, str]) -> tuple[str | None, str]:
    """(what is wrong with the file or None, its sha256): checked against the pin, then against the sha256
    SHA256SUMS recorded when it was first downloaded."""
    sha256, blob = file_hashes(path)
    if spec.sha256 and sha256 != spec.sha256:
        return f"{spec.dest}: sha256 {sha256}, expected {spec.sha256} (pinned)", sha256
    if spec.git_blob and blob != spec.git_blob:
        return (f"{spec.dest}: git blob id {blob}, expected {spec.git_blob} (pinned: ORZ's file at commit "
                f"{ORZ_COMMIT[:7]})"), sha256
    recorded = manifest.get(spec.dest)
    if recorded and recorded != sha256:
        return (f"{spec.dest}: sha256 {sha256}, expected {recorded} (recorded in {MANIFEST} when it was "
                "downloaded)"), sha256
    return None, sha256


# --- download ------------------------------------------------------------------------------------------------


def _what_to_do(url: str, spec: DataFile, dest: Path, reached: bool) -> str:
    first = (f"Is --base-url (or ${BASE_URL_ENV}) a copy of {ORZ_REPO} at commit {ORZ_COMMIT}?" if reached else
             f"Check that {urllib.parse.urlsplit(url).netloc or url} is reachable from this machine (or point "
             f"--base-url / ${BASE_URL_ENV} at a mirror of {ORZ_REPO} at commit {ORZ_COMMIT}).")
    return (f"{first} Or download {spec.remote} from that repository at that commit by other means and put it at "
            f"{dest}; `{FETCH_COMMAND} --check` then verifies it.")


def download(url: str, part: Path, label: str, timeout_s: float = TIMEOUT_S) -> None:
    """`url` into `part`, with a progress bar on a terminal; DataError naming the URL when it cannot."""
    from tqdm import tqdm

    req = urllib.request.Request(url, headers={"User-Agent": "pipelinerl-data"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp, open(part, "wb") as f:
        total = int(resp.headers.get("Content-Length") or 0) or None
        with tqdm(total=total, unit="B", unit_scale=True, desc=label, leave=False,
                  disable=not sys.stderr.isatty()) as bar:
            while chunk := resp.read(1 << 20):
                f.write(chunk)
                bar.update(len(chunk))


def fetch_file(spec: DataFile, out: Path, base_url: str, manifest: dict[str, str]) -> str:
    """Make `out/spec.dest` ORZ's verified file; returns what was done. DataError on failure, with nothing left
    at the destination name (or its temporary name)."""
    dest = out / spec.dest
    if dest.exists():
        problem, sha256 = mismatch(spec, dest, manifest)
        if problem is None:
            record(out, spec.dest, sha256)  # a file put there by hand gets its manifest entry too
            return f"ok       {spec.dest} (already there, verified)"
        # not ORZ's file: removed so nothing trains or evaluates on it, then fetched again
        print(f"{problem}; removing it and downloading it again", file=sys.stderr)
        dest.unlink()
    dest.parent.mkdir(parents=True, exist_ok=True)
    url = base_url.rstrip("/") + "/" + spec.remote
    part = dest.with_name(f".{dest.name}.part")
    try:
        try:
            download(url, part, spec.dest)
        except urllib.error.HTTPError as e:
            raise DataError(f"{spec.dest}: {url} answered HTTP {e.code} {e.reason}. "
                            f"{_what_to_do(url, spec, dest, reached=True)}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            reason = getattr(e, "reason", e)
            raise DataError(f"{spec.dest}: could not download {url}: {reason}. "
                            f"{_what_to_do(url, spec, dest, reached=False)}") from None
        problem, sha256 = mismatch(spec, part, manifest)
        if problem is not None:
            raise DataError(f"downloaded file does not match its checksum, deleted: {problem}. The file at {url} "
                            "is not the pinned one (a wrong --base-url, a proxy's error page, or a truncated "
                            "download); try again, or use a mirror of ORZ's repository at that commit")
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)
    record(out, spec.dest, sha256)
    manifest[spec.dest] = sha256
    pin = f"sha256 {spec.sha256[:12]}..." if spec.sha256 else f"git blob id {spec.git_blob[:12]}..."
    return f"fetched  {spec.dest} ({dest.stat().st_size:,} bytes, {pin} verified)"


# --- AIME 2025 from the Hugging Face hub ---------------------------------------------------------------------


def _get_json(url: str, timeout_s: float = 30.0) -> dict:
    req = urllib.request.Request(url, headers={"User-Agent": "pipelinerl-data"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def hub_rows(name: str, split: str | None = None, rows_url: str | None = None) -> list[dict]:
    """A hub dataset's rows through the hub's dataset viewer API (plain HTTP + JSON, no `datasets` package)."""
    base = (rows_url or os.environ.get(HF_ROWS_URL_ENV) or DEFAULT_HF_ROWS_URL).rstrip("/")
    splits = _get_json(f"{base}/splits?" + urllib.parse.urlencode({"dataset": name}))["splits"]
    if not splits:
        raise ValueError(f"the hub lists no splits for {name!r}")
    wanted = [split] if split else ["test", "train"]
    chosen = next((s for w in wanted for s in splits if s["split"] == w), None if split else splits[0])
    if chosen is None:
        raise ValueError(f"{name!r} has no split {split!r} (it has {', '.join(s['split'] for s in splits)})")
    rows: list[dict] = []
    while True:
        query = urllib.parse.urlencode({"dataset": name, "config": chosen["config"], "split": chosen["split"],
                                        "offset": len(rows), "length": 100})
        page = _get_json(f"{base}/rows?{query}")
        cut = sorted({c for r in page["rows"] for c in r.get("truncated_cells") or []})
        if cut:  # the viewer shortens cells of large rows to 100 bytes: such rows are not the data
            raise ValueError(f"the hub's dataset viewer truncates the {', '.join(cut)} cells of {name!r}; install "
                             "the `datasets` package (pip install datasets), which reads the whole files")
        rows.extend(r["row"] for r in page["rows"])
        if not page["rows"] or len(rows) >= page.get("num_rows_total", 0):
            return rows


def load_aime2025(source: str) -> list[dict]:
    """Problems ({"problem", "answer", ...}) from a local JSON/JSONL file, or a hub dataset "name[:split]": with
    the `datasets` package where it is installed, else through the hub's dataset viewer API."""
    from pipelinerl.tasks.math_data import load_file, load_hub, normalize

    if Path(source).exists():
        return load_file(source)
    if source.endswith((".json", ".jsonl")):
        raise FileNotFoundError(f"no file {source}")
    name, _, split = source.partition(":")
    try:
        import datasets  # noqa: F401
    except ImportError:
        return [normalize(row, i, name) for i, row in enumerate(hub_rows(name, split or None))]
    return load_hub(name, split or None)


def fetch_aime2025(source: str, out: Path, manifest: dict[str, str]) -> str:
    """`out/eval/aime2025.json` in ORZ's eval format from `source`. Raises DataError when it cannot; the caller
    carries on without it."""
    dest = out / AIME2025_DEST
    spec = DataFile(AIME2025_DEST, "")
    if dest.exists():
        problem, sha256 = mismatch(spec, dest, manifest)
        if problem is None:
            record(out, AIME2025_DEST, sha256)
            return f"ok       {AIME2025_DEST} (already there, matches {MANIFEST})"
        print(f"{problem}; converting it again from {source}", file=sys.stderr)
    try:
        problems = load_aime2025(source)
    except Exception as e:  # no hub, no such dataset, a network error mid-way: all mean "not now"
        raise DataError(f"{AIME2025_DEST}: could not get AIME 2025 from {source!r} ({type(e).__name__}: "
                        f"{str(e)[:300]})") from None
    if not problems:
        raise DataError(f"{AIME2025_DEST}: {source!r} has no problems")
    # ORZ's eval format, as its own eval files: the loaders read this like aime2024.json
    records = [{"prompt": [{"from": "user", "value": p["problem"]}], "final_answer": p["answer"]} for p in problems]
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(f".{dest.name}.part")
    part.write_text(json.dumps(records, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(part, dest)
    sha256, _ = file_hashes(dest)
    record(out, AIME2025_DEST, sha256)
    manifest[AIME2025_DEST] = sha256
    return f"made     {AIME2025_DEST} ({len(records)} problems from {source}; sha256 recorded in {MANIFEST})"


# --- check ---------------------------------------------------------------------------------------------------


def check(out: Path, files: Iterable[DataFile] = ORZ_FILES, aime2025: bool = True) -> tuple[list[str], bool]:
    """(one line per file, whether all are present and verified), downloading nothing."""
    manifest = read_manifest(out)
    lines, ok = [], True
    specs = list(files) + ([DataFile(AIME2025_DEST, "")] if aime2025 else [])
    for spec in specs:
        path = out / spec.dest
        if not path.exists():
            ok = False
            lines.append(f"missing  {spec.dest}")
            continue
        problem, _ = mismatch(spec, path, manifest)
        if problem is not None:
            ok = False
            lines.append(f"MISMATCH {problem}")
        elif spec.sha256 or spec.git_blob:
            lines.append(f"ok       {spec.dest} ({'sha256' if spec.sha256 else 'git blob id'} matches the pin"
                         + (f", sha256 matches {MANIFEST})" if spec.dest in manifest and spec.git_blob else ")"))
        elif spec.dest in manifest:
            lines.append(f"ok       {spec.dest} (not pinned: sha256 matches {MANIFEST})")
        else:
            lines.append(f"present  {spec.dest} (not pinned, not in {MANIFEST}: unverified)")
    return lines, ok


def report_check(lines: list[str], ok: bool, out: Path, command: str, default_out: str) -> int:
    """Print `check`'s lines (and, when something is missing or wrong, the command that fetches it); the exit code."""
    print("\n".join(lines))
    if not ok:
        print(f"{out}: not complete; `{command}" + ("" if str(out) == default_out else f" --out {out}")
              + "` fetches what is missing", file=sys.stderr)
    return 0 if ok else 1


def missing_data_hint(path: str) -> str | None:
    """For a data path that is one of `pipelinerl data orz`'s files (data/orz/eval/aime2024.json, or the same names
    under another directory), the command that fetches it; None for any other path. Whether the path exists is
    the caller's business."""
    p = Path(path)
    for dest in [f.dest for f in ORZ_FILES] + [AIME2025_DEST]:
        parts = Path(dest).parts
        if p.parts[-len(parts):] != parts:
            continue
        root = Path(*p.parts[:-len(parts)]) if len(p.parts) > len(parts) else Path(".")
        command = FETCH_COMMAND if root == Path(DEFAULT_OUT) else f"{FETCH_COMMAND} --out {root}"
        if dest == AIME2025_DEST:
            return (f"`{command}` makes it from the Hugging Face dataset {AIME2025_DEFAULT} (AIME 2025 is not in "
                    "ORZ's repository), which needs the hub; without it, drop it from task.args.eval_data")
        also = " (or `make data-orz`)" if command == FETCH_COMMAND else ""
        return f"fetch it with `{command}`{also}"
    from pipelinerl.data_prorl import missing_data_hint as prorl_hint

    return prorl_hint(path)


# --- command line --------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pipelinerl.data_prorl import DEFAULT_OUT as PRORL_OUT
    from pipelinerl.data_prorl import PRORL_SOURCES

    p.add_argument("dataset", choices=["orz", "prorl", "model"],
                   help="orz: Open-Reasoner-Zero's training and eval sets; prorl: the hub sources of "
                        "recipes/prorl_1p5b.yaml's domains (pipelinerl/data_prorl.py); model NAME: a model of the "
                        "Hugging Face hub into its cache (HF_HOME), once, as a run's launcher does before any engine "
                        "starts")
    p.add_argument("name", nargs="?", default=None, help="with `model`: the hub name, e.g. Qwen/Qwen2.5-7B")
    p.add_argument("--out", default=None,
                   help=f"directory to fill (default: {DEFAULT_OUT} for orz, {PRORL_OUT} for prorl)")
    p.add_argument("--check", action="store_true",
                   help="verify the files already there against their pins and SHA256SUMS; download nothing")
    p.add_argument("--base-url", default=None,
                   help=f"where ORZ's repository files are (default: ${BASE_URL_ENV}, else {DEFAULT_BASE_URL})")
    names = [f.name for f in ORZ_FILES] + ["aime2025"]
    p.add_argument("--only", action="append", default=None, metavar="NAME",
                   choices=names + [s.name for s in PRORL_SOURCES],
                   help="fetch only this file (repeatable): orz: " + ", ".join(names) + "; prorl: "
                        + ", ".join(s.name for s in PRORL_SOURCES))
    p.add_argument("--aime2025", default=AIME2025_DEFAULT, metavar="SOURCE",
                   help="Hugging Face dataset (name or name:split) or local JSON/JSONL file for AIME 2025, which "
                        f"is not in ORZ's repository (default: {AIME2025_DEFAULT}); needs a reachable hub")
    p.add_argument("--no-aime2025", action="store_true", help="skip AIME 2025")


EPILOG = f"""\
Files and pins (ORZ repository {ORZ_REPO} at commit {ORZ_COMMIT}):
  eval/aime2024.json, eval/math500.json, eval/gpqa_diamond.json: pinned by sha256.
  orz_math_57k_collected.json, orz_math_72k_collection_extended.json, orz_math_13k_collection_hard.json: pinned by
    their git blob ids (sha1 of "blob <size>\\0" + content), because their contents were not available when the
    pins were made, only the repository tree; the sha256 of each verified download is recorded in SHA256SUMS and
    checked by every later run.
  eval/aime2025.json: not in ORZ's repository; converted from a Hugging Face dataset (--aime2025) where the hub is
    reachable, recorded in SHA256SUMS.
"""


def fetch_model_main(name: str | None) -> int:
    """`pipelinerl data model NAME`: the model's config, tokenizer and safetensors weights into the hub's cache;
    prints the local directory (what a recipe's model.path may also name)."""
    from pipelinerl.models.hub import ModelFetchError, fetch_model, is_hub_name

    if not name or not is_hub_name(name):
        print(f"pipelinerl data model: give a Hugging Face model name such as Qwen/Qwen2.5-7B (got {name!r})",
              file=sys.stderr)
        return 2
    try:
        path = fetch_model(name)
    except ModelFetchError as e:
        print(f"pipelinerl data model: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


def main(args: argparse.Namespace) -> int:
    if args.dataset == "model":
        return fetch_model_main(args.name)
    if args.name is not None:
        print(f"pipelinerl data {args.dataset}: takes no name (got {args.name!r})", file=sys.stderr)
        return 2
    only = set(args.only or [])
    if args.dataset == "prorl":
        from pipelinerl import data_prorl

        stray = only - {s.name for s in data_prorl.PRORL_SOURCES}
        if stray:
            print(f"pipelinerl data prorl: --only {', '.join(sorted(stray))} is not one of its files", file=sys.stderr)
            return 2
        return data_prorl.main(Path(args.out or data_prorl.DEFAULT_OUT), only, args.check)
    out = Path(args.out or DEFAULT_OUT)
    stray = only - {f.name for f in ORZ_FILES} - {"aime2025"}
    if stray:
        print(f"pipelinerl data orz: --only {', '.join(sorted(stray))} is not one of its files", file=sys.stderr)
        return 2
    files = [f for f in ORZ_FILES if not only or f.name in only]
    want_aime2025 = not args.no_aime2025 and (not only or "aime2025" in only)
    if args.check:
        return report_check(*check(out, files, want_aime2025), out, FETCH_COMMAND, DEFAULT_OUT)
    base_url = args.base_url or os.environ.get(BASE_URL_ENV) or DEFAULT_BASE_URL
    out.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(out)
    try:
        for spec in files:
            print(fetch_file(spec, out, base_url, manifest), flush=True)
    except DataError as e:
        print(f"pipelinerl data orz: {e}", file=sys.stderr)
        return 1
    if want_aime2025:
        try:
            print(fetch_aime2025(args.aime2025, out, manifest), flush=True)
        except DataError as e:
            print(f"pipelinerl data orz: {e}.\nCarrying on without AIME 2025: a recipe listing {out / AIME2025_DEST} "
                  "in task.args.eval_data (recipes/orz_7b.yaml does) will not start until it is there. Run this again "
                  "where the Hugging Face hub is reachable, or pass --aime2025 FILE (a JSON/JSONL file of "
                  "problem/answer records), or drop it from task.args.eval_data.", file=sys.stderr)
    print(f"data in {out}")
    return 0
