import pytest
from dist_harness import DistributedRunner


@pytest.fixture(scope="session")
def distributed():
    """``distributed.run(fn, *args, world_size=N)`` runs ``fn`` on N gloo ranks."""
    runner = DistributedRunner()
    yield runner
    runner.close()
