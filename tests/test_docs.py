"""The README fits a screen, the docs site builds strictly (a broken link fails), and the
configuration reference is the schema's: generated, and stale the moment a knob changes."""

import shutil
import subprocess
import sys

import pytest
import yaml

from harness.report import config_reference
from harness.config.config_check import YAML_GROUPS, declared_keys, yaml_defaults
from harness.report.config_reference import comment_choices
from tests.conftest import PROJECT

README_MAX_LINES = 150


def test_readme_fits_a_screen():
    lines = (PROJECT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move text to docs/"


def test_the_configuration_reference_is_up_to_date():
    assert config_reference.main(["--check"]) == 0, "run: python -m harness.report.config_reference"


def reference_rows() -> set[str]:
    text = (PROJECT / "docs" / "configuration.md").read_text()
    return {line.split("`")[1] for line in text.splitlines() if line.startswith("| `")}


def test_every_declared_knob_has_a_row():
    """Against the keys the config check itself accepts (not the generator's own reading)."""
    from methods import SHARED_KNOBS, available_methods
    from tasks import available_tasks

    rows = reference_rows()
    wanted = set()
    for name in available_methods():
        wanted |= {f"method.{k}" for k in declared_keys("method", None, name)
                   if k != "name" and k not in SHARED_KNOBS}
    for name in available_tasks():
        wanted |= {f"task.{k}" for k in declared_keys("task", None, name) if k != "name"}
    for group in YAML_GROUPS:
        for path in (config_reference.CONF_DIR / group).glob("[!_]*.yaml"):
            wanted |= {f"{group}.{k}" for k in yaml_defaults(group, path.stem) if k != "name"}
    assert wanted - rows == set()
    text = (PROJECT / "docs" / "configuration.md").read_text()
    assert all(f"`method.{k}`" in text for k in SHARED_KNOBS)


def test_the_allowed_values_from_the_code_hold_the_yaml_defaults():
    for key, values in config_reference.allowed_constants().items():
        group, knob = key.split(".")
        for path in (config_reference.CONF_DIR / group).glob("[!_]*.yaml"):
            declared = yaml_defaults(group, path.stem)
            if knob in declared:
                assert declared[knob] in values, (path.name, knob, declared[knob], values)


@pytest.mark.parametrize("comment, default, choices", [
    ("sdpa | eager", "sdpa", ("sdpa", "eager")),
    ("none | cpu: full K/V on the host", "none", ("none", "cpu")),
    ("counter (paper) | lru | fifo, when pool_capacity < 1", "counter", ("counter", "lru", "fifo")),
    ("select_per=kv_head: scores -> score: max | mean | prob_mean", "max", ()),  # prose: no guess
    ("a sweep's settings decoded together | 1: each alone", 1, ()),
    ("tokens per prefill forward", "x", ()),
])
def test_allowed_values_are_read_from_a_comment_only_when_unambiguous(comment, default, choices):
    assert comment_choices(comment, default) == choices


def mkdocs_build(root, site) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "--config-file", str(root / "mkdocs.yml"), "--site-dir", str(site)],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def docs_copy(tmp_path_factory):
    """mkdocs.yml and docs/ copied aside (the build never writes into the checkout)."""
    root = tmp_path_factory.mktemp("docs")
    shutil.copy(PROJECT / "mkdocs.yml", root / "mkdocs.yml")
    shutil.copytree(PROJECT / "docs", root / "docs")
    return root


def test_the_site_builds_strictly_and_a_broken_link_fails_it(docs_copy, tmp_path):
    built = mkdocs_build(docs_copy, tmp_path / "site")
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "site" / "configuration.html").is_file()
    assert (tmp_path / "site" / "methods" / "h2o.html").is_file()
    page = docs_copy / "docs" / "running.md"
    page.write_text(page.read_text() + "\nSee [the knobs](configuration-old.md).\n")
    broken = mkdocs_build(docs_copy, tmp_path / "site2")
    assert broken.returncode != 0 and "configuration-old.md" in broken.stderr


def test_every_nav_page_exists():
    """A page missing from the nav still builds (mkdocs.yml: omitted_files info), so a page
    added beside these never breaks the site; one the nav names must exist."""
    config = yaml.safe_load((PROJECT / "mkdocs.yml").read_text())

    def pages(node):
        if isinstance(node, str):
            yield node
        elif isinstance(node, list):
            for item in node:
                yield from pages(item)
        elif isinstance(node, dict):
            for value in node.values():
                yield from pages(value)

    listed = set(pages(config["nav"]))
    assert listed and all((PROJECT / "docs" / p).is_file() for p in listed), listed
    assert config["validation"]["omitted_files"] == "info"
