import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # so tests can `import tiny`

from tiny import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Builds a tiny random model of each architecture once per session: tiny_model_dir("llama")."""
    cache: dict[tuple, Path] = {}

    def build(arch: str = "llama", **overrides) -> Path:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = make_tiny_model(tmp_path_factory.mktemp(arch), arch, **overrides)
        return cache[key]

    return build


@pytest.fixture
def pool_checked_after_each_test(request):
    """For modules that share one `llm` across tests (`pytestmark = pytest.mark.usefixtures(...)`): after each
    test that used it, no block is still in use and the pool's bookkeeping is intact."""
    yield
    if "llm" in request.fixturenames:
        llm = request.getfixturevalue("llm")
        if not llm.engine.closed:
            assert llm.stats()["used_blocks"] == 0
            llm.engine.check_integrity()
