from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
PACE_EXACT = SHARED_DATA / "pace2017-exact"
PACE_HEURISTIC = SHARED_DATA / "pace2017-heuristic"


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long benchmark-like tests")


@pytest.fixture(scope="session")
def pace_exact_dir() -> Path:
    if not (PACE_EXACT / "treewidth.txt").is_file():
        pytest.skip(f"PACE 2017 exact instances not found at {PACE_EXACT} (shared/ beside the repository)")
    return PACE_EXACT


@pytest.fixture(scope="session")
def pace_heuristic_dir() -> Path:
    if not PACE_HEURISTIC.is_dir() or not list(PACE_HEURISTIC.glob("*.gr*")):
        pytest.skip(f"PACE 2017 heuristic instances not found at {PACE_HEURISTIC}")
    return PACE_HEURISTIC
