"""What the test ranks' fork server imports once, so that no rank imports it again.

Imported by the fork server of tests/helpers/dist_harness.py (``set_forkserver_preload``)
before it forks any rank. A rank is forked at every pool start and after every failed
distributed test; each used to import what its tests needed on its own: Dynamo and
Inductor, TRL, datasets, accelerate, PEFT, transformers' model modules and usp's
integrations, 5% of the samples of a py-spy profile of the suite (2026-12-07), with four
ranks importing the same modules side by side on two cores; and each compiling rank's
first Inductor compile hashed torch's and triton's sources for Inductor's cache key and
probed the CPU's vector instruction sets (below). Then everything imported is
frozen out of the garbage collector's walk (``freeze_imported_modules``): the forked
ranks share it, and their first freeze has nothing left to walk.

A library that is not installed, or fails to import, is skipped here (the extras are
optional): the fork server must start whatever happens, and a test that needs the library
fails on its own import with its own traceback.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import warnings

from dist_harness import freeze_imported_modules

#: each is what some pooled test imports in its ranks
MODULES = (
    "torch",
    "torch.distributed",
    "transformers.modeling_utils",
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "usp",
    "usp.train.trainer",
    "usp.integrations.transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "trl",
    "datasets",
    "peft",
    "usp.integrations.hf_trl",
)

with warnings.catch_warnings():
    # import-time notes (fla: "Triton is not supported on current platform") would
    # print between pytest's header and its first line: the server starts with the session
    warnings.simplefilter("ignore")
    for name in MODULES:
        with contextlib.suppress(Exception):
            importlib.import_module(name)

with contextlib.suppress(Exception):
    # What each compiling rank's first Inductor compile did once per process, cached
    # here for every rank: Inductor's cache key hashes triton's sources (0.5 s) and
    # torch's (0.3 s), and the CPU's vector instruction sets are probed by building and
    # loading a test library per set (1.6 s a process once the libraries are in the
    # Inductor cache; building them, ~8 s of g++, runs here beside the collection on a
    # cold cache). The 2-rank Inductor training launch took 23.5 and 27.8 s with these
    # three, 34.6 and 35.4 s without (alternated runs, cold caches, 2026-12-07). Since
    # the suite compiles scalar kernels (tests/conftest.py), the probes build nothing
    # unless ``TORCHINDUCTOR_VEC_ISA_OK=1`` asks for vectorized ones. Nothing that
    # touches CUDA: a forked rank could not initialise it again.
    from torch._inductor.codecache import torch_key, triton_key
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    triton_key()
    torch_key()
    valid_vec_isa_list()

freeze_imported_modules()
# the fork server's own exit: back in the collector's reach first (frozen extension
# objects, e.g. triton's, would be reported as leaks); forked ranks leave by os._exit
# and unfreeze in dist_harness._worker_main
atexit.register(gc.unfreeze)
