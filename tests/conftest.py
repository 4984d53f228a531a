import os
import tempfile

# The suite writes nothing outside temporary folders: what dspark_fn keeps (and the hub's cache) goes to one of
# its own, set before dspark_fn is imported (its OpenBLAS may be placed there) and inherited by child processes.
SCRATCH = tempfile.mkdtemp(prefix="dspark-tests-")
os.environ["DSPARK_FN_CACHE"] = os.path.join(SCRATCH, "dspark_fn")
os.environ["HF_HOME"] = os.path.join(SCRATCH, "huggingface")

import dspark_fn  # noqa: E402,F401  first, before any test module loads mlx: OpenBLAS then serves MLX (blas.py)

import faulthandler  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

from dspark_fn.constraints import compile_constraint  # noqa: E402
from grammars import CONSTRAINTS, JSON_PIECES, JSON_VOCAB, vocabulary  # noqa: E402
from helpers import PARITY, missing_prerequisite  # noqa: E402

# a hung server test fails after this, instead of stalling the run
SERVER_TEST_SECONDS = int(os.environ.get("DSPARK_SERVER_TEST_SECONDS", "300"))
SERVER_TESTS_RAN = pytest.StashKey[bool]()
STDERR = pytest.StashKey[int]()  # the terminal's stderr: pytest captures fd 2 while a test runs


def pytest_configure(config):
    config.stash[STDERR] = os.dup(sys.stderr.fileno())


def pytest_collection_modifyitems(items):
    """The tests of the modules ``test_serve*`` are marked ``server``."""
    for item in items:
        if getattr(item, "module", None) is not None and item.module.__name__.startswith("test_serve"):
            item.add_marker(pytest.mark.server)


@pytest.fixture(autouse=True)
def server_test_limit(request):
    """A ``server`` test still running after ``SERVER_TEST_SECONDS`` fails
    (every thread's stack printed first) and its teardown runs, so a hang
    ends the test, not the run, and leaves no server behind. Should the main
    thread never get back to Python (stuck in native code), faulthandler
    ends the whole run a minute later, stacks printed."""
    if request.node.get_closest_marker("server") is None:
        yield
        return
    request.config.stash[SERVER_TESTS_RAN] = True

    def expired(signum, frame):
        faulthandler.dump_traceback(all_threads=True)
        pytest.fail(f"still running after {SERVER_TEST_SECONDS} s: a hang (every thread's stack above)", pytrace=False)

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(SERVER_TEST_SECONDS)
    faulthandler.dump_traceback_later(SERVER_TEST_SECONDS + 60, exit=True, file=request.config.stash[STDERR])
    try:
        yield
    finally:
        signal.alarm(0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="session")
def parity_dir():
    if not PARITY.is_dir():
        missing_prerequisite(f"parity fixtures not found at {PARITY} (set DSPARK_PARITY_DIR)")
    return PARITY


def pytest_unconfigure(config):
    """Server tests start threads (uvicorn's, the engine's, asyncio's
    executor's); should one left waiting keep the interpreter from exiting,
    faulthandler ends the run a minute from now (or the test limit, if
    shorter), every stack printed."""
    if config.stash.get(SERVER_TESTS_RAN, False):
        faulthandler.dump_traceback_later(min(60, SERVER_TEST_SECONDS), exit=True, file=config.stash[STDERR])
    shutil.rmtree(SCRATCH, ignore_errors=True)


@pytest.fixture(scope="module")
def vocab():
    """The JSON pieces' vocabulary of the constraint tests (``grammars``)."""
    return vocabulary(JSON_PIECES, JSON_VOCAB)


@pytest.fixture(scope="module")
def grammars(vocab):
    """Each of ``grammars.CONSTRAINTS`` compiled over ``vocab``."""
    return {name: compile_constraint(constraint, vocab) for name, constraint in CONSTRAINTS.items()}
