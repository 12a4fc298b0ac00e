import gc
import os

# Inductor's C++ kernels in the tests are scalar loops, not vectorized: the same graphs,
# collectives and overlap pass, numerics within the compile tests' tolerances, and no
# code that depends on the CPU's vector instruction sets (AVX2, AVX-512, AMX: the suite
# runs on any x86-64). g++ builds them faster, and a process's first compile no longer
# probes the instruction sets: the compile files took 34 and 36 s less of 239-271 s
# (alternated runs, cold caches, 2026-12-08). Set before anything imports Inductor's
# config; every rank and launched process inherits it. ``TORCHINDUCTOR_VEC_ISA_OK=1``
# in the environment compiles the vectorized kernels instead.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import pytest  # noqa: E402
from dist_harness import (  # noqa: E402
    DistributedRunner,
    freeze_imported_modules,
    start_fork_server,
)


def pytest_sessionstart(session):
    """The pooled ranks' fork server starts now, so that its imports run beside the
    collection of the tests (pytest's process uses one core meanwhile) instead of
    delaying the first distributed test."""
    start_fork_server()


def pytest_runtest_setup(item):
    """Between tests, what the imports so far made leaves the garbage collector's walk
    (see ``freeze_imported_modules``): pytest's process, as every pooled rank."""
    freeze_imported_modules()


def pytest_sessionfinish(session, exitstatus):
    """Back in the collector's reach for the interpreter's shutdown (which would report
    frozen extension objects as leaks)."""
    gc.unfreeze()


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
