"""benchmarks/compiled_schedule.py without Inductor (its code generation takes minutes on
two busy cores; docs/architecture.md runs it): the listing it reads from generated code, the count of
overlapped collectives, and its verdict, on code in the form Inductor 2.13 writes."""

from __future__ import annotations

import json

import pytest
from usp_cases import load_benchmark

compiled_schedule = load_benchmark("compiled_schedule")

HEAD = "class Runner:\n    def call(self, args):\n"
POST = "        buf{0} = torch.ops._c10d_functional.all_to_all_single.default(buf{1}, [0, 8], [8, 0], '0')\n"
WAIT = "        torch.ops._c10d_functional.wait_tensor.default(buf{0})\n"
KERNEL = (
    "        buf{0} = torch.ops.usp.dense_forward.default(primals_1, buf{1}, 'cpu', True, 0.25)\n"
)
FUSED = "        cpp_fused_addcmul_exp_0(buf{0}, buf{1})\n"


def _source(*statements: str) -> str:
    return HEAD + "".join(statements)


SERIAL = _source(POST.format(3, 2), WAIT.format(3), KERNEL.format(4, 2), KERNEL.format(5, 3),
                 FUSED.format(4, 5))  # fmt: skip
OVERLAPPED = _source(POST.format(3, 2), KERNEL.format(4, 2), WAIT.format(3),
                     KERNEL.format(5, 3), FUSED.format(4, 5))  # fmt: skip


def test_the_listing_and_the_overlap_count():
    assert compiled_schedule.listing(OVERLAPPED) == [
        "post all_to_all_single -> buf3", "kernel dense_forward", "wait buf3",
        "kernel dense_forward", "fused cpp_fused_addcmul_exp_0",
    ]  # fmt: skip
    assert compiled_schedule.overlapped(compiled_schedule.listing(OVERLAPPED)) == (1, 1)
    assert compiled_schedule.overlapped(compiled_schedule.listing(SERIAL)) == (0, 1)


@pytest.mark.parametrize("with_pass,fails", [(OVERLAPPED, False), (SERIAL, True)])
def test_the_verdict_reads_the_forward_compiled_with_the_usp_options(
    monkeypatch, tmp_path, with_pass, fails
):
    def generated(ulysses, ring, ring_impl, options):
        return [SERIAL if options is None else with_pass, SERIAL]

    monkeypatch.setattr(compiled_schedule, "_generated_code", generated)
    argv = ["--grid", "1x2", "--out", str(tmp_path)]
    if fails:
        with pytest.raises(SystemExit, match="only 0 of the 1 forward shifts are overlapped"):
            compiled_schedule.main(argv)
        return
    report = compiled_schedule.main(argv)
    saved = json.loads((tmp_path / "compiled_schedule.json").read_text())
    assert saved == report and set(report) == {"inductor defaults", "usp.compile_options()"}
