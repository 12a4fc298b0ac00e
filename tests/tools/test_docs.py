"""README.md and docs/*.md stay true: the README's API example runs, links resolve.

The README's ```python block is the first code a newcomer copies: it runs here on 4 gloo
ranks, verbatim except for its two process-group lines (the test harness owns the world).
Every relative markdown link of README.md and docs/*.md must name a file of the
repository and, with ``#anchor``, a heading of that file (GitHub's anchors).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_CODE_SPAN = re.compile(r"`+[^`]*`+")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a ``# comment`` in code is no heading)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(text):
        match = _HEADING.match(line)
        if not match:
            continue
        anchor = github_anchor(match.group(2))
        n = seen.get(anchor, 0)
        seen[anchor] = n + 1
        found.add(anchor if n == 0 else f"{anchor}-{n}")
    return found


def relative_links(text: str) -> list[str]:
    """Link targets that are not URLs; a link's text may run over lines."""
    prose = _CODE_SPAN.sub("", "\n".join(prose_lines(text)))
    targets = [match.group(1) for match in _LINK.finditer(prose)]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]  # not http:, ...


def test_the_anchor_rules():
    assert github_anchor("Fitting long sequences: memory levers and context extension") == (
        "fitting-long-sequences-memory-levers-and-context-extension"
    )
    assert github_anchor("Checking long context: `usp eval`") == "checking-long-context-usp-eval"
    assert github_anchor("Training data (`[data]`)") == "training-data-data"
    assert github_anchor("HF Trainer and TRL: `usp.integrations.transformers`") == (
        "hf-trainer-and-trl-uspintegrationstransformers"
    )
    text = "# A\n```bash\n# not a heading\n```\n## A\n### B `c`\n"
    assert anchors(text) == {"a", "a-1", "b-c"}
    line = "see [x](docs/a.md#b), [y\n  z](#c), [z](https://e.org) and `[w](not/a/link.md)`"
    assert relative_links(line) == ["docs/a.md#b", "#c"]


def test_every_relative_link_resolves():
    assert len(DOCUMENTS) > 1, "docs/*.md is missing"
    broken = []
    for document in DOCUMENTS:
        for target in relative_links(document.read_text(encoding="utf-8")):
            path, _, anchor = target.partition("#")
            file = (document.parent / path).resolve() if path else document
            where = f"{document.relative_to(ROOT)}: {target}"
            if not file.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and file.suffix == ".md":
                if anchor not in anchors(file.read_text(encoding="utf-8")):
                    broken.append(f"{where} (no heading with that anchor)")
            elif not file.is_relative_to(ROOT):
                broken.append(f"{where} (outside the repository)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_stays_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines < 300, f"README.md has {lines} lines: move reference text to docs/"


def readme_example() -> str:
    """The README's first ```python block, its two process-group lines made no-ops."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"^```python\n(.*?)^```$", text, re.S | re.M)
    assert match, "README.md has no ```python block (the API example)"
    code = match.group(1)
    for line in ('dist.init_process_group("gloo")', "dist.destroy_process_group()"):
        assert code.count(line) == 1, f"the README's example should call {line} once"
        code = code.replace(line, "pass")
    return code


def run_readme_example(code: str):
    namespace: dict = {"__name__": "__readme__"}
    exec(compile(code, "README.md (python block)", "exec"), namespace)
    full, ref = namespace["full"], namespace["ref"].transpose(1, 2)  # SDPA's [B, H, S, D]
    return (
        tuple(full.shape),
        float((full - ref).abs().max()),
        namespace["plan"].comm_stats.snapshot(),
    )


def test_the_readme_api_example_runs_on_4_ranks(distributed):
    for shape, error, traffic in distributed.run(
        run_readme_example, readme_example(), world_size=4
    ):
        assert shape[1] > 4 and error < 1e-5, (shape, error)
        # it ran distributed: Ulysses all-to-alls and the ring's exchange both moved bytes
        assert traffic["all_to_all"]["sent"] > 0 and traffic["p2p"]["sent"] > 0, traffic
