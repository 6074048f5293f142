"""The configuration reference, generated from the config's dataclasses: every key with its type, its default and
the comments written beside it in `pipelinerl/config.py`. `make config-reference` writes docs/config_reference.md;
a test checks that the committed file is what this generates, so the reference cannot drift from the code.

`python -m pipelinerl.config_reference > docs/config_reference.md`
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import tokenize
import typing
from pathlib import Path

from pipelinerl import config

HEADER = """# Configuration reference

Every key of a recipe, with its type, its default and what it does, generated from `pipelinerl/config.py` by
`make config-reference` (`tests/test_contract.py` checks it is fresh). A recipe YAML sets any of them, and so does a
dotted override on the command line (`trainer.lr=1e-6`); `preset=NAME` loads an algorithm's settings from
`recipes/presets/`. docs/configuration.md explains how they combine.
"""


def _comment_text(comment: str) -> str:
    """A comment without ruff's `noqa: CODE` marker (what follows it in parentheses is kept)."""
    if comment.startswith("noqa"):
        _, _, rest = comment.partition("(")
        return rest.rsplit(")", 1)[0].strip() if rest else ""
    return comment


def _field_comments(cls: type) -> dict[str, str]:
    """What the comments of config.py say of each field of `cls`: the comment lines above it and the comment at
    the end of its line. A field with none that sits in a block of fields under another's comment (no blank line
    between) points to that field, whose comment covers the block."""
    source = inspect.getsource(cls)
    lines = source.splitlines()
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = _comment_text(tok.string.lstrip("#").strip())
    tree = ast.parse(source)
    out: dict[str, str] = {}
    block_head, last_end = None, -1
    for node in tree.body[0].body:  # type: ignore[attr-defined]
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, row = [], node.lineno - 1
        while row >= 1 and row in comments and lines[row - 1].strip().startswith("#"):
            above.insert(0, comments[row])
            row -= 1
        trailing = [comments[r] for r in range(node.lineno, (node.end_lineno or node.lineno) + 1)
                    if r in comments and not lines[r - 1].strip().startswith("#")]
        text = " ".join(c for c in [*above, *trailing] if c)
        contiguous = last_end == node.lineno - 1
        if above:
            block_head = node.target.id
        elif not contiguous:
            block_head = None
        if not text and block_head is not None:
            text = f"see `{block_head}`"
        out[node.target.id] = text
        last_end = node.end_lineno or node.lineno
    return out


def _type_name(tp: object) -> str:
    text = tp.__name__ if isinstance(tp, type) else str(tp)
    return text.replace("typing.", "").replace("Optional[", "optional ").replace("]", "").replace("[", " of ")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
        if dataclasses.is_dataclass(value):
            return "(section)"
    else:
        return "(required)"
    if value == "???":
        return "(required)"
    return f"`{value!r}`" if value not in ("", None) else ("unset" if value is None else '`""`')


def _section(prefix: str, cls: type, rows: list[str], sections: list[tuple[str, type]]) -> None:
    comments = _field_comments(cls)
    hints = typing.get_type_hints(cls, vars(config))
    for f in dataclasses.fields(cls):
        tp = hints.get(f.name, f.type)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            sections.append((f"{prefix}{f.name}.", tp))
            continue
        what = comments.get(f.name, "").replace("|", "\\|")
        rows.append(f"| `{prefix}{f.name}` | {_type_name(tp)} | {_default(f)} | {what} |")


def render() -> str:
    """The reference's markdown."""
    out = [HEADER]
    pending: list[tuple[str, type]] = [("", config.RunConfig)]
    while pending:
        prefix, cls = pending.pop(0)
        rows: list[str] = []
        nested: list[tuple[str, type]] = []
        _section(prefix, cls, rows, nested)
        title = prefix.rstrip(".") or "run"
        doc = (cls.__doc__ or "").strip()
        if doc.startswith(cls.__name__ + "("):  # the dataclass's generated signature, not a docstring
            doc = ""
        out += [f"## `{title}`", ""]
        if doc:
            out += [" ".join(doc.split()), ""]
        out += ["| key | type | default | what |", "| --- | --- | --- | --- |", *rows, ""]
        pending = nested + pending
    return "\n".join(out).rstrip() + "\n"


def main() -> None:
    print(render(), end="")


REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "config_reference.md"

if __name__ == "__main__":
    main()
