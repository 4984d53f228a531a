"""The package's layer order, as docs/architecture.md's "Layers" block states it: each
module imports only modules of its own layer or of the layers above it, and
no import chain comes back to where it started.

Checked two ways: statically, every ``import`` in every module (those inside
functions too, and the package each imported module sits in, which Python
loads first); and by importing each module alone in a fresh interpreter
(a child forked before any ``dspark_fn`` module is loaded) and listing what
it loaded. ``import dspark_fn.types`` loads no model family.

Breaks tried, and what caught them: ``types`` importing ``DraftArch`` from
``drafts.base`` again (the fresh interpreter loads every draft family; the
family check), a target reading its files through ``checkpoints`` (an edge
up from the families, and a cycle), ``schedule`` importing ``costs`` (an
edge up inside the round layer is allowed, the cycle it closes is not).
"""

import ast
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dspark_fn"


def stated_layers() -> list[list[str]]:
    """docs/architecture.md's layers, top first: the names in each line of the fenced block under "### Layers"."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"### Layers\n.*?```\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no fenced block under '### Layers'"
    return [line.split()[1:] for line in block.group(1).splitlines() if line.strip()]


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def layer_of(module: str, layers: list[list[str]]) -> int:
    """The index of the layer that names ``module`` or a package holding it."""
    short = module.removeprefix("dspark_fn.")
    for index, names in enumerate(layers):
        if any(short == name or short.startswith(name + ".") for name in names):
            return index
    raise AssertionError(f"{module} is in none of the layers of docs/architecture.md: add it to the '### Layers' block")


def imports(module: str, path: Path, known: dict, parents: bool = True) -> set[str]:
    """The ``dspark_fn`` modules ``module`` imports anywhere in its file (with
    ``parents``, also the packages above them, which Python loads first)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    if parents:
        found = {".".join(name.split(".")[:end]) for name in found for end in range(2, len(name.split(".")) + 1)}
    return {name for name in found if name in known and name != module}


def test_every_module_imports_only_its_layer_and_the_layers_above():
    layers, known = stated_layers(), modules()
    upward = [
        f"{module} ({layers[layer_of(module, layers)][0]}) imports {used} ({layers[layer_of(used, layers)][0]})"
        for module, path in known.items() if module != "dspark_fn"
        for used in sorted(imports(module, path, known))
        if used != "dspark_fn" and layer_of(used, layers) > layer_of(module, layers)
    ]
    assert not upward, "imports against docs/architecture.md's layer order:\n" + "\n".join(upward)


def test_no_import_chain_comes_back():
    """(A registry package importing its families is not a chain: Python
    loads the package before the family module that sits in it.)"""
    known = modules()
    graph = {module: imports(module, path, known, parents=False) - {"dspark_fn"} for module, path in known.items()}
    for start in graph:
        seen, stack = set(), [start]
        while stack:
            for used in graph[stack.pop()]:
                assert used != start, f"an import chain from {start} comes back to it"
                if used not in seen:
                    seen.add(used)
                    stack.append(used)


def loaded_alone(module: str) -> set[str]:
    """The ``dspark_fn`` modules loaded by importing ``module`` in a fresh
    interpreter state (a forked child; MLX and NumPy are loaded before)."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        os.close(read)
        try:
            __import__(module)
            report = "\n".join(name for name in sys.modules if name.startswith("dspark_fn"))
        except BaseException as error:  # noqa: BLE001 - the parent raises it
            report = f"!{type(error).__name__}: {error}"
        os.write(write, report.encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    os.waitpid(child, 0)
    report = b"".join(chunks).decode()
    assert not report.startswith("!"), f"import {module}: {report[1:]}"
    return set(report.splitlines())


def test_each_module_alone_loads_only_its_layer_and_the_layers_above(tmp_path):
    """The fresh-interpreter check runs in a subprocess of its own, so that
    this test process (which has loaded the package) forks nothing."""
    import subprocess

    script = tmp_path / "alone.py"
    script.write_text(
        "import sys\n"
        f"sys.path[:0] = [{str(ROOT)!r}, {str(Path(__file__).parent)!r}]\n"
        "import mlx.core, numpy\n"
        "import test_layers as check\n"
        "check.check_each_module_alone()\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def check_each_module_alone() -> None:
    layers, problems = stated_layers(), []
    for module in sorted(modules()):
        if module == "dspark_fn":
            continue
        loaded = loaded_alone(module) - {"dspark_fn"}
        over = sorted(name for name in loaded if layer_of(name, layers) > layer_of(module, layers))
        if over:
            problems.append(f"{module} loads {', '.join(over)}")
    assert not problems, "\n".join(problems)


def test_importing_the_records_loads_no_family():
    import subprocess

    code = "import sys, dspark_fn.types; print(' '.join(m for m in sys.modules if m.startswith('dspark_fn')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split())
    blas = {"dspark_fn.blas", "dspark_fn.cachedir", "dspark_fn.atomic"}  # the package's import loads OpenBLAS
    assert loaded == {"dspark_fn", "dspark_fn.types", "dspark_fn.interfaces"} | blas, loaded
