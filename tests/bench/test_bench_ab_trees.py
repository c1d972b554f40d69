"""bench/ab_trees.py runs each version in its own child process and compares like with like."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import ab_trees  # noqa: E402


def test_same_tree_twice_reports_equal_tokens(capsys):
    ab_trees.main(["--a", "WORKTREE", "--b", "WORKTREE", "--batch", "1", "--rounds", "1", "--repeats", "1",
                   "--prompt-len", "4", "--output-len", "3"])
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 | async")]
    assert len(row) == 1 and row[0].rstrip().endswith("| yes |"), row


def test_child_that_imports_another_tree_is_refused(tmp_path):
    # A tree without namazu/ makes the child import whatever else is on the path (or fail): either way
    # the measurement must not be attributed to that tree.
    spec = dict(batch=1, scheduling="sync", graph=False, threads=1, prompt_len=4, output_len=2, seed=0, repeats=1)
    with pytest.raises(RuntimeError):
        ab_trees.measure(tmp_path, spec, timeout_s=120)


@pytest.mark.skipif(subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode,
                    reason="not a git checkout")
def test_export_of_a_commit_has_the_package_and_built_extensions(tmp_path):
    tree = ab_trees.export_tree("HEAD", tmp_path)
    assert (tree / "namazu" / "engine" / "llm_engine.py").is_file()
    for so in (ROOT / "namazu").glob("*.so"):
        assert (tree / "namazu" / so.name).is_file()
