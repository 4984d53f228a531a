"""mlx-vlm is an extra (``dspark_fn/optional.py``): without it a DeepSeek-V4
target is refused at load, and a multimodal release loads its text model
but refuses images, each naming ``pip install '.[vlm]'``; the text path
never imports it.

Breaks tried: ``require_vlm`` left out of DeepSeek-V4's ``load_params`` (a
bare ModuleNotFoundError from mlx-vlm's import instead of the fix), the
vision side built without the check (the problem named mlx-vlm's import
error, not the extra).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import dspark_fn
from dspark_fn import optional, vision
from dspark_fn.cli import main
from dspark_fn.targets import TARGET_REGISTRY

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def without_vlm(monkeypatch):
    """mlx-vlm as if not installed: found by no finder, and its import failing."""
    real = optional.find_spec
    monkeypatch.setattr(optional, "find_spec", lambda name: None if name == "mlx_vlm" else real(name))
    monkeypatch.setitem(sys.modules, "mlx_vlm", None)


def test_a_deepseek_v4_target_names_the_extra(tmp_path, without_vlm, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    with pytest.raises(optional.MissingExtra, match=r"a deepseek_v4 target needs mlx-vlm.*pip install '\.\[vlm\]'"):
        dspark_fn.load(tmp_path, tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--draft", str(tmp_path), "Hi"]) == 2
    assert "pip install '.[vlm]'" in capsys.readouterr().err


def test_a_release_without_mlx_vlm_refuses_images_with_the_fix(tmp_path, without_vlm):
    release = next(adapter_release for adapter in TARGET_REGISTRY.values() for adapter_release in adapter.releases
                   if adapter_release.images is not None)
    config = {"model_type": release.model_type, "text_config": {"model_type": release.text_model_type}}
    side = vision.load_vision(tmp_path, config)
    assert side is not None and side.problem.startswith("reading images needs mlx-vlm")
    assert optional.VLM_FIX in side.problem


def test_the_text_path_imports_no_mlx_vlm():
    code = ("import sys, dspark_fn; from dspark_fn import driver, checkpoints, catalog, cli, policy; "
            "print(sorted(m for m in sys.modules if m.startswith('mlx_vlm')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
