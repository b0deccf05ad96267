"""MkDocs hooks: the site's home page is the README and its benchmarks page is BENCHMARKS.md
(which `brisk bench report` writes at the repository's root), published as they are without a
copy in docs/. Their links are written for GitHub, from the root (`docs/serving.md`,
`BENCHMARKS.md`); the pages' links to the benchmarks are `../BENCHMARKS.md`, which GitHub
follows too. Here all of them are pointed at the site's pages."""

from __future__ import annotations

import os
import re

from mkdocs.structure.files import File

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _from_root(text: str) -> str:
    """A root file's links, as seen from the site's top folder."""
    text = re.sub(r"\]\(docs/", "](", text)
    return re.sub(r"\]\(BENCHMARKS\.md", "](benchmarks.md", text)


def on_files(files, config):
    for source, name in (("README.md", "index.md"), ("BENCHMARKS.md", "benchmarks.md")):
        with open(os.path.join(_ROOT, source), encoding="utf-8") as f:
            files.append(File.generated(config, name, content=_from_root(f.read())))
    return files


def on_page_markdown(markdown, page, config, files):
    return markdown.replace("](../BENCHMARKS.md", "](benchmarks.md")
