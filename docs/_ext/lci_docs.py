"""Pages of the docs made from the sources they describe, at every build.

* ``_generated/configuration.md``: one row per option of ``lci.yaml``, with
  its default, what the option's own validation accepts
  (:data:`dask_lcicomm.config.OPTIONS`, a provider's ``section``) and the
  comment above it in the YAML.
* ``_generated/results/<run>.md``: every run saved in ``docs/results/``, as
  ``python -m benchmarks report`` writes it, figures included.
* ``_generated/asap/<run>.md``: the table of each ASAP run in
  ``docs/results/asap/``.

Nothing here is edited by hand, so the docs cannot drift from the code or
from the measurements.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import yaml

from benchmarks.asap import records_table
from benchmarks.report import markdown_table, write_page
from benchmarks.workloads import report_page
from dask_lcicomm.config import DEFAULTS, OPTIONS, SECTIONS, Kind
from dask_lcicomm.providers import registry

_KEY = re.compile(r"^( {6}| {8})([a-z][a-z-]*):")
_COMMENT = re.compile(r"^( {6}| {8})# ?(.*)$")


def option_comments(text: str) -> dict[str, str]:
    """The comment block above each option in ``lci.yaml`` (a block is
    shared by the options that follow it up to the next block), by dotted
    key: a provider's section's options as ``<section>.<option>``."""
    comments: dict[str, str] = {}
    block: list[str] = []
    current, section = "", ""
    for line in text.splitlines():
        if m := _COMMENT.match(line):
            block.append(m.group(2))
        elif m := _KEY.match(line):
            if block:
                current = " ".join(block)
                block = []
            nested = len(m.group(1)) == 8
            if not nested:
                section = m.group(2)
            comments[f"{section}.{m.group(2)}" if nested else m.group(2)] = current
    return comments


def _options() -> list[tuple[str, Any, Kind]]:
    """(dotted key, default, kind) of every option: the core's, then each
    provider section's."""
    core = [(key, DEFAULTS[key], kind) for key, kind in OPTIONS.items()]
    sections = [(f"{name}.{key}", DEFAULTS[name][key], kind)
                for name in SECTIONS if (section := registry.get(name).section) is not None
                for key, kind in section.options.items()]
    return core + sections


def _default(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
    return f"`{text}`"


def configuration_table(yaml_text: str) -> str:
    comments = option_comments(yaml_text)
    rows = ([f"`{key}`", _default(default), kind.accepts(), comments[key].replace("|", "\\|")]
            for key, default, kind in _options())
    return markdown_table(["key", "default", "accepts", "meaning"], rows) + "\n"


def _generate(app: Any) -> None:
    docs = Path(app.srcdir)
    out = docs / "_generated"
    shutil.rmtree(out, ignore_errors=True)
    (out / "results").mkdir(parents=True)
    (out / "asap").mkdir()
    (out / "workloads").mkdir()
    yaml_text = (docs.parent / "dask_lcicomm" / "lci.yaml").read_text()
    (out / "configuration.md").write_text(configuration_table(yaml_text))
    for results in sorted((docs / "results").glob("*.json")):
        write_page(results, out / "results" / f"{results.stem}.md", out / "results" / results.stem)
    for results in sorted((docs / "results" / "asap").glob("*.json")):
        table = records_table(json.loads(results.read_text()))
        (out / "asap" / f"{results.stem}.md").write_text(table + "\n")
    for results in sorted((docs / "results" / "workloads").glob("*.json")):
        page = report_page(json.loads(results.read_text()))
        (out / "workloads" / f"{results.stem}.md").write_text(page)


def setup(app: Any) -> dict[str, Any]:
    app.connect("builder-inited", _generate)
    return {"parallel_read_safe": True}
