import pytest

from helpers import PARITY, missing_prerequisite


@pytest.fixture(scope="session")
def parity_dir():
    if not PARITY.is_dir():
        missing_prerequisite(f"parity fixtures not found at {PARITY} (set DSPARK_PARITY_DIR)")
    return PARITY
