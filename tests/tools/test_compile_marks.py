"""usp.compile_marks: torch.compile's marks without importing torch's compiler.

The marks must act under ``torch.compile`` as torch's own decorators do: a constant
result is computed once while the graph is traced, a disabled function runs eagerly.
"""

import torch

from usp.compile_marks import CONSTANT_RESULT_ATTRIBUTE, compiler_disabled, constant_result


def test_constant_result_sets_what_torchs_decorator_sets():
    def plain():
        return 0

    def marked():
        return 0

    before = dict(vars(marked))
    torch._dynamo.assume_constant_result(marked)
    assert {k: v for k, v in vars(marked).items() if k not in before} == {
        CONSTANT_RESULT_ATTRIBUTE: True
    }
    assert constant_result(plain) is plain
    assert vars(plain) == {CONSTANT_RESULT_ATTRIBUTE: True}


def test_a_constant_result_is_computed_once_while_tracing():
    calls = []

    @constant_result
    def scale() -> float:
        calls.append(torch.compiler.is_compiling())
        return 2.0 + len(calls)  # a traced (not constant) call would change every time

    compiled = torch.compile(lambda x: x * scale(), backend="eager", fullgraph=True)
    x = torch.ones(3)
    for _ in range(3):
        torch.testing.assert_close(compiled(x), x * 3.0)
    # run once, while the graph was traced: the graph holds its result
    assert calls == [True]


def test_a_disabled_function_runs_eagerly_under_compile():
    seen = []

    @compiler_disabled
    def record(x):
        seen.append(torch.compiler.is_compiling())
        return x + 1

    compiled = torch.compile(lambda x: record(x * 2) * 3, backend="eager")
    x = torch.arange(3.0)
    for _ in range(2):
        torch.testing.assert_close(compiled(x), (x * 2 + 1) * 3)
    assert seen == [False, False]  # called on every run, never traced
    torch.testing.assert_close(record(x), x + 1)  # eager callers see the function
    assert record.__name__ == "record"
