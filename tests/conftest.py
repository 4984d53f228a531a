import pytest

from helpers import PARITY


@pytest.fixture(scope="session")
def parity_dir():
    if not PARITY.is_dir():
        pytest.skip(f"parity fixtures not found at {PARITY} (set DSPARK_PARITY_DIR)")
    return PARITY
