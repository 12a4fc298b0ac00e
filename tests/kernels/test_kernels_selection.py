"""Backend selection fails loudly: ``auto`` says what it skipped and why, never falls back
to ``math`` off the CPU beyond a stated size, and raises with every backend's reason.

CUDA backends are replaced here by fakes with given verdicts (a failed self-check, a
missing package, a limit), so the selection logic runs on any machine; ``math`` is the
real one (it accepts CUDA specs without touching a GPU).
"""

from __future__ import annotations

import logging
import types

import pytest
import torch

from usp.kernels import AttentionSpec, BackendUnavailableError, select_backend, selection
from usp.kernels import spec as kernel_spec
from usp.kernels.backends import registry
from usp.kernels.backends.base import Backend, BackendFailure

CUDA = torch.device("cuda")  # only inspected, never allocated on


class FakeBackend(Backend):
    device_types = ("cuda", "cpu")
    self_checked = False

    def __init__(self, name, reason, *, varlen=False):
        self.name = name
        self.reason = reason
        self.supports_varlen = varlen

    def extra_unsupported_reason(self, spec):
        return self.reason

    def forward(self, *args):  # selection must not run a kernel
        raise AssertionError("select_backend ran a kernel")

    backward = varlen_forward = varlen_backward = forward


SELF_CHECK_FAILED = BackendFailure("failed its self-check on cuda:0 (out off by 0.41 relative)")
NOT_INSTALLED = (
    "needs the flash_attn package (pip install 'usp[flash-attn]'), which is not installed"
)


@pytest.fixture
def fakes(monkeypatch):
    """Fake CUDA backends (verdicts editable per test); a fresh report-once memory."""
    backends = {
        "cudnn": FakeBackend("cudnn", SELF_CHECK_FAILED),
        "flash_attn": FakeBackend("flash_attn", NOT_INSTALLED, varlen=True),
        "flash": FakeBackend("flash", BackendFailure("is not in this torch build"), varlen=True),
        "efficient": FakeBackend("efficient", None),
    }
    # usp's registry (what select_backend and registry.get read) looking names up in
    # ``backends`` first, live: a test may replace a fake after the fixture ran
    real = registry.DEFAULT
    live = types.SimpleNamespace(get=lambda name: backends.get(name) or real.get(name))
    monkeypatch.setattr(registry, "DEFAULT", live)
    monkeypatch.setattr(selection, "_reported_skips", set())
    return backends


def _spec(device=CUDA, *, batch=1, seqlen=64, heads=8, varlen=False):
    return AttentionSpec(
        batch, seqlen, seqlen, heads, 2, 64, torch.bfloat16, device, True, None, varlen=varlen
    )


def test_auto_warns_once_per_failed_backend_and_logs_every_skip(fakes, caplog):
    caplog.set_level(logging.INFO, logger="usp.kernels")
    with pytest.warns(RuntimeWarning) as warned:
        assert select_backend(_spec()).name == "efficient"
    messages = [str(w.message) for w in warned]
    assert len(messages) == 2  # the two failures; the missing package is only logged
    assert (
        "'cudnn' skipped by auto: it failed its self-check on cuda:0 (out off by 0.41"
        in messages[0]
    )
    assert "using 'efficient'" in messages[0]
    assert "'flash' skipped by auto: it is not in this torch build" in messages[1]
    logged = {(r.levelname, r.getMessage().split(":")[0]) for r in caplog.records}
    assert ("WARNING", "attention backend 'cudnn' skipped by auto") in logged
    assert ("INFO", "attention backend 'flash_attn' skipped by auto") in logged
    # once per (backend, reason): a second call, or a thousand layers, say nothing new
    caplog.clear()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert select_backend(_spec(seqlen=128)).name == "efficient"
    assert caplog.records == []


def test_auto_falls_back_to_math_on_cuda_only_for_small_calls(fakes):
    fakes["efficient"].reason = BackendFailure("failed its self-check on cuda:0 (dq off by 1)")
    limit = selection.MATH_AUTO_MAX_SCORES
    small = _spec(batch=1, seqlen=1024, heads=16)  # 1 * 16 * 1024 * 1024 = 2**24 scores
    assert small.batch * small.num_heads * small.seqlen_q * small.seqlen_k == limit
    with pytest.warns(RuntimeWarning):
        assert select_backend(small).name == "math"
    large = _spec(batch=2, seqlen=1024, heads=16)
    with pytest.raises(BackendUnavailableError) as raised:
        select_backend(large)
    message = str(raised.value)
    for expected in (
        "no attention backend can run this call (cuda, torch.bfloat16, batch=2, Sq=1024",
        "cudnn: it failed its self-check on cuda:0 (out off by 0.41 relative)",
        "flash_attn: it needs the flash_attn package",
        "flash: it is not in this torch build",
        "efficient: it failed its self-check on cuda:0 (dq off by 1)",
        f"math: it would materialise {2 * limit} float32 scores (B*H*Sq*Sk) on cuda; "
        f"auto falls back to it there only up to {limit} (backend='math' forces it)",
    ):
        assert expected in message
    # asked for by name, math runs at any size
    assert select_backend(large, "math").name == "math"


def test_on_cpu_math_is_the_fallback_at_any_size(fakes, monkeypatch):
    fakes["cpu"] = FakeBackend("cpu", SELF_CHECK_FAILED)
    with pytest.warns(RuntimeWarning, match="'cpu' skipped by auto: it failed its self-check"):
        assert select_backend(_spec(torch.device("cpu"), batch=64, seqlen=4096)).name == "math"


def test_packed_calls_prefer_varlen_kernels_and_report_skips(fakes):
    fakes["flash"].reason = None
    assert select_backend(_spec(varlen=True)).name == "flash"
    fakes["flash"].reason = SELF_CHECK_FAILED
    with pytest.warns(RuntimeWarning):  # falls to the per-document loop of efficient
        assert select_backend(_spec(varlen=True, seqlen=96)).name == "efficient"


def test_a_named_backend_that_failed_says_why_and_which_can(fakes):
    with pytest.raises(
        BackendUnavailableError,
        match=r"attention backend 'cudnn' cannot run this call \(cuda.*\): it failed its "
        r"self-check on cuda:0 \(out off by 0.41 relative\)\. Backends that can: efficient, math",
    ):
        select_backend(_spec(), "cudnn")


def test_selection_and_scale_validation_run_no_kernel(fakes):
    """What a distributed call does before its first collective: both must raise (or
    pass) without touching a kernel; the fakes raise if a kernel is called."""
    assert select_backend(_spec(), "efficient").name == "efficient"
    with pytest.raises(BackendUnavailableError):
        select_backend(_spec(), "flash")
    assert kernel_spec.default_scale(128, None) == 128**-0.5
