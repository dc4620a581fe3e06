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
