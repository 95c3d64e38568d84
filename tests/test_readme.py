"""The examples of README.md and docs/*.md run as written (issues 22 and 38), and their links resolve.

Every fenced block of the README and of every docs page is either run here or tagged as not run:
- ```python blocks run, each section's blocks in order in one namespace (a section: a `## ` heading of the README,
  a `# ` heading, the page title, of a docs page). The documented setup: `ckpt` is an HF checkpoint directory
  (here a tiny random Qwen3-style one), and every other section continues from the `model`, `prompt`, `responses`
  and `adv` of docs/library.md (so that page runs first, fresh, in each of their namespaces). docs/sharding.md
  runs as a one-rank torchrun job would: gloo, world size 1.
- bare ``` (or ```bash) blocks must be `$ longstraw state-size ...` / `$ longstraw plan ...` transcripts: every
  `$ ` line runs through the CLI entry point and must exit 0 with output starting with the page's next line.
- ```yaml blocks are excerpts of a config in configs/: the first line names it (`# configs/x.yaml`), every other
  line appears in that file, in order, and the file loads as a run config.
- ```text (output, layouts), ```console (commands too slow for a test: `make run`, `longstraw train`,
  `longstraw plan` at the real sizes, 35-45 s each) and ```mermaid (diagrams) are not run.
Any other block fails `test_every_block_is_run_or_tagged`, so a new example cannot go untested silently.
Every relative link and image must name a file that exists, and every #anchor a heading of its page; when mkdocs
is installed (`make test` installs the `docs` extra), the site builds with `mkdocs build --strict`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import os
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import longstraw as ls
from longstraw.models import write_weights

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
LIBRARY = "docs/library.md: Use it as a library"  # the section the other sections continue from
NOT_RUN = ("text", "console", "mermaid")  # explicit tags of blocks this test does not run
SHELL = ("", "bash")
COMMANDS = ("$ longstraw state-size", "$ longstraw plan")
DISTRIBUTED = "docs/sharding.md: "  # the page that initialises torch.distributed

# a tiny random Qwen3-style checkpoint: the byte tokenizer's vocab (259) and room for a 16K-token prompt
TINY = dict(model_type="qwen3", vocab_size=259, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=32768,
            rms_norm_eps=1e-6, tie_word_embeddings=False)


@dataclass(frozen=True)
class Block:
    section: str  # "<page>: <heading>": the enclosing "## " heading of the README, the "# " title of a docs page
    tag: str  # the fence's language tag ("" for a bare fence)
    text: str
    line: int  # 1-based line of the opening fence
    page: str  # the file, relative to the repository root

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def page_blocks(path: Path) -> list[Block]:
    page = path.relative_to(ROOT).as_posix()
    heading = "## " if path == README else "# "
    blocks, section, fence, body = [], f"{page}: ", None, []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if fence is None:
            if line.startswith(heading):
                section = f"{page}: {line[len(heading):].strip()}"
            elif line.startswith("```"):
                fence, body = (line[3:].strip(), n), []
        elif line.rstrip() == "```":
            blocks.append(Block(section, fence[0], "\n".join(body) + "\n", fence[1], page))
            fence = None
        else:
            body.append(line)
    assert fence is None, f"{page}: the block opened at line {fence[1]} is never closed"
    return blocks


BLOCKS = [b for path in PAGES for b in page_blocks(path)]
PY_SECTIONS = list(dict.fromkeys(b.section for b in BLOCKS if b.tag == "python"))
SHELL_BLOCKS = [b for b in BLOCKS if b.tag in SHELL]


def test_every_block_is_run_or_tagged():
    untested = []
    for b in BLOCKS:
        if b.tag in ("python", "yaml") or b.tag in NOT_RUN:
            continue
        if b.tag in SHELL and b.text.startswith(COMMANDS):
            continue
        untested.append(f"{b.where} ({b.section}): ```{b.tag} {b.text.splitlines()[0]!r}")
    assert not untested, ("blocks neither run by tests/test_readme.py nor tagged ```text / ```console: "
                          + "; ".join(untested))
    assert LIBRARY in PY_SECTIONS, "the other sections continue from " + LIBRARY


def test_page_one_is_page_one():
    """The README stays a first page: two set-up commands, the rest in docs/."""
    text = README.read_text()
    assert len(text.splitlines()) < 200, "README.md is page one: move the details to a docs/ page"
    setup = next(b for b in BLOCKS if b.page == "README.md" and b.tag == "console")
    assert [line.split("#")[0].strip() for line in setup.text.splitlines()] == ["make run", "make test"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-qwen3")
    torch.manual_seed(0)
    write_weights(ls.build_model(TINY), path)
    return str(path)


def _grads(model) -> list[tuple[str, torch.Tensor | None]]:
    out = []
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "to_local"):  # FSDP: this rank's shard
            g = g.to_local()
        out.append((name, g))
    return out


def _check(block: Block, ns: dict) -> None:
    """What a block's result should be, where that is cheap to see."""
    text = block.text
    if "stats = ls.grpo_backward(" in text:
        stats = ns["stats"]
        assert stats["mode"] == "exact" and math.isfinite(stats["loss"])
        assert stats["tokens"] == sum(len(r) for r in ns["responses"])
    if "grpo_backward(" in text or "ls.prompt_backward(" in text:
        grads = _grads(ns["model"])
        got = [g for _, g in grads if g is not None]
        assert got, "no parameter has a gradient"
        assert all(torch.isfinite(g).all() for g in got)
        assert any(g.abs().sum() > 0 for g in got), "every gradient is zero"
        if "ls.add_lora(" in text:
            assert all(("lora" in n) == (g is not None) for n, g in grads), "LoRA: gradients of the adapters only"
    if "ls.capture(" in text:
        assert ns["state"].nbytes > 0
    if "ls.score(" in text:
        assert [lp.shape for lp in ns["logps"]] == [(len(r),) for r in ns["responses"]]
        assert all(torch.isfinite(lp).all() and (lp <= 0).all() for lp in ns["logps"])
    if "ls.rollout(" in text:
        assert len(ns["samples"]) == 8 and len(ns["rewards"]) == 8 and ns["failed"] == 0
    if "shard_model(" in text:
        assert ls.parallel.is_sharded(ns["model"])


def _run_section(section: str, ns: dict) -> None:
    for b in (b for b in BLOCKS if b.tag == "python" and b.section == section):
        code = compile(b.text, f"{b.where} ({section})", "exec")
        exec(code, ns)  # noqa: S102 - the docs' own examples
        _check(b, ns)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("section", PY_SECTIONS)
def test_python_blocks_run(section, ckpt, monkeypatch):
    ns: dict = {"__name__": "readme", "ckpt": ckpt}
    if section != LIBRARY:
        _run_section(LIBRARY, ns)
    if not section.startswith(DISTRIBUTED):
        _run_section(section, ns)
        return
    import torch.distributed as dist

    # what torchrun sets for a one-process job
    for key, val in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=str(_free_port())).items():
        monkeypatch.setenv(key, val)
    try:
        _run_section(section, ns)
        assert dist.is_initialized() and dist.get_world_size() == 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _transcript(block: Block) -> list[tuple[str, str]]:
    """(command, the header line the README shows after it) for every `$ ` line of a shell block."""
    lines = block.text.splitlines()
    out = []
    for i, line in enumerate(lines):
        if line.startswith("$ "):
            assert i + 1 < len(lines) and not lines[i + 1].startswith("$ "), \
                f"{block.where}: {line!r} shows no output"
            out.append((line[2:], lines[i + 1]))
    return out


@pytest.mark.parametrize("block", [b for b in SHELL_BLOCKS if b.text.startswith(COMMANDS)],
                         ids=lambda b: b.where)
def test_shell_blocks_run(block, monkeypatch):
    from flows.cli import main

    monkeypatch.chdir(ROOT)  # the pages' paths are relative to the repository root
    commands = _transcript(block)
    assert commands
    for command, header in commands:
        argv = shlex.split(command)
        assert argv[0] == "longstraw" and "..." not in argv, \
            f"{block.where}: {command!r} does not run as written"
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(argv[1:])
        assert code in (0, None), f"{command!r} exited {code}"
        assert out.getvalue().startswith(header), f"{command!r} printed:\n{out.getvalue()}\nREADME shows:\n{header}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.tag == "yaml"], ids=lambda b: b.where)
def test_yaml_blocks_are_excerpts_of_configs_that_load(block):
    from longstraw.config import load_config
    from longstraw.train.config import TrainConfig

    first, *lines = block.text.splitlines()
    assert first.startswith("# configs/"), f"{block.where}: a yaml block names its file on its first line"
    path = ROOT / first[2:].strip()
    have = path.read_text().splitlines()
    at = 0
    for line in lines:
        assert line in have[at:], f"{block.where}: {line!r} is not in {path.name} (after line {at})"
        at = have.index(line, at) + 1
    load_config(path, TrainConfig)


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")  # [text](target) and ![alt](target)


def _prose(path: Path) -> list[tuple[int, str]]:
    """The lines outside fenced blocks, inline code removed (a link inside backticks is not a link)."""
    out, fence = [], False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            fence = not fence
        elif not fence:
            out.append((n, re.sub(r"`[^`]*`", "", line)))
    return out


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens (mkdocs' toc agrees for
    the headings these pages link to; its strict build checks them again)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {anchor(line.lstrip("#")) for _, line in _prose(path) if re.match(r"#{1,6} ", line)}


@pytest.mark.parametrize("path", [*PAGES, ROOT / "bench" / "README.md", ROOT / "infra" / "README.md"],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_resolve(path):
    broken = []
    for n, line in _prose(path):
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not checked offline
                continue
            file, _, frag = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.name}:{n}: {target} (no file {dest.relative_to(ROOT)})")
            elif frag and dest.suffix == ".md" and frag not in anchors(dest):
                broken.append(f"{path.name}:{n}: {target} (no heading #{frag} in {dest.relative_to(ROOT)})")
    assert not broken, "broken links: " + "; ".join(broken)


def test_link_check_sees_a_broken_link(tmp_path):
    """The check above finds what it is for: a missing file and a missing heading."""
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n## Two words\n\n[ok](#two-words) [gone](missing.md) `[code](missing.md)`\n"
                    "![no image](img/none.png) [no heading](#three-words)\n")
    assert anchors(page) == {"a-page", "two-words"}
    found = [t for _, line in _prose(page) for t in LINK.findall(line)]
    assert found == ["#two-words", "missing.md", "img/none.png", "#three-words"]


def test_every_docs_page_is_in_the_site_navigation():
    """mkdocs.yml's nav is the table of contents: every page of docs/ is in it, and docs/index.md links to each."""
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def files(entries) -> list[str]:
        out = []
        for entry in entries:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            out += files(value) if isinstance(value, list) else [value]
        return out

    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert sorted(files(nav)) == pages
    index = {t.partition("#")[0] for _, line in _prose(ROOT / "docs" / "index.md") for t in LINK.findall(line)}
    assert set(pages) - {"index.md"} <= index, f"docs/index.md does not link to {sorted(set(pages) - index)}"


@pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("mkdocs", "material")),
                    reason="mkdocs or its material theme is not installed: make docs (or pip install -e '.[docs]')")
def test_site_builds_strict(tmp_path):
    """`make docs` as a test: a warning (a broken link, a page left out of the nav) fails the strict build."""
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                          str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "site" / "index.html").exists() and (tmp_path / "site" / "library" / "index.html").exists()
