import pytest
from dist_harness import DistributedRunner


@pytest.fixture(scope="session")
def distributed():
    """``distributed.run(fn, *args, world_size=N)`` runs ``fn`` on N gloo ranks."""
    runner = DistributedRunner()
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread while a module's tests run (tiny tensors and fake tensors:
    more threads only cost time, much of it on a busy machine). Opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
