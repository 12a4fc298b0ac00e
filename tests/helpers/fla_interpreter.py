"""fla's Triton kernels on CPU tensors, under Triton's interpreter (``TRITON_INTERPRET=1``):
a test mode, checked with fla-core 0.6.0 and triton 3.9.0 (the dev extra pins them).

Two gaps between the interpreter and fla, bridged here in the test process (never in
usp): Triton's autotuner times its configs on a GPU driver (there is none: keep each
kernel's first config, the interpreter runs any config the same), and the interpreter
passes a ``for`` loop's induction variable as a Python int where fla calls tensor methods
on it (``i_t.to(tl.int64)``): it is wrapped as the interpreter wraps an assignment
(``interpreter_semantic.to_tensor``). Both must be in place before fla is imported.
"""

from __future__ import annotations

import ast
import contextlib
import os

FLA_CORE, TRITON = "0.6.0", "3.9.0"  # the versions these adjustments were checked with
_patched = False


def _visit_for(self, node):
    node = self.generic_visit(node)
    if isinstance(node.target, ast.Name):  # i = interpreter_semantic.to_tensor(i, False)
        wrap = ast.Assign(
            targets=[ast.Name(id=node.target.id, ctx=ast.Store())],
            value=ast.Call(
                func=ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()),
                                   attr="to_tensor", ctx=ast.Load()),
                args=[ast.Name(id=node.target.id, ctx=ast.Load()), ast.Constant(value=False)],
                keywords=[],
            ),
        )  # fmt: skip
        node.body = [wrap, *node.body]
    return node


def adjust_triton() -> None:
    """The two adjustments, once per process, before fla is imported."""
    global _patched
    if _patched:
        return
    import triton.runtime.autotuner as autotuner
    import triton.runtime.interpreter as interpreter

    first_config_only = autotuner.Autotuner.__init__

    def init(self, fn, arg_names, configs, *args, **kwargs):
        first_config_only(self, fn, arg_names, configs[:1], *args, **kwargs)

    autotuner.Autotuner.__init__ = init
    interpreter.ASTTransformer.visit_For = _visit_for
    _patched = True


@contextlib.contextmanager
def interpreted_ranks(world_size: int):
    """A private pool of ``world_size`` gloo ranks started with ``TRITON_INTERPRET=1``
    (spawned, not forked from the shared fork server: the interpreter must be on when
    triton itself is first imported, or its standard library's ``@jit`` functions stay
    compiled-mode ones, and the fork server imported triton already); its ``run(fn, *args,
    timeout=...)`` runs ``fn`` on every rank after :func:`adjust_triton`. Closed after."""
    import importlib.metadata as metadata
    import multiprocessing as mp

    from dist_harness import WorkerPool

    versions = metadata.version("fla-core"), metadata.version("triton")
    if versions != (FLA_CORE, TRITON):
        raise RuntimeError(f"fla-core/triton {versions}, checked with {(FLA_CORE, TRITON)}")
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # inherited by the spawned ranks
    try:
        pool = WorkerPool(world_size, mp.get_context("spawn"))
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before
    try:
        yield _Ranks(pool)
    finally:
        pool.close()


class _Ranks:
    def __init__(self, pool):
        self._pool = pool

    def run(self, fn, *args, timeout: float):
        return self._pool.run(_adjusted, (fn, *args), {}, timeout)


def _adjusted(fn, *args):
    adjust_triton()
    return fn(*args)
