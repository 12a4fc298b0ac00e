"""The set-up check of forced kernels for every usp mixer layer an HF model can hold after
``swap_linear_attention`` (issue 57: Mamba-2, KDA, the short conv, Mamba-1, as Gated
DeltaNet's): ``usp.integrations.hf_setup.kernel_problem`` names the layer kind, the forced
choice, why it cannot run here and what to set instead; ``auto`` / ``torch`` pass. One
process, no kernel runs (the kernels' limits: fla and causal-conv1d run on CUDA only here).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hybrid_cases import HYBRID, build

pytest.importorskip("transformers", minversion="5.25")

import usp  # noqa: E402
from usp.integrations.hf_setup import kernel_problem  # noqa: E402
from usp.models import hf as usp_hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)

CPU = torch.device("cpu")
#: model type -> (the layer kind as the refusal names it, whether a forced "fla" is refused
#: for its recurrence's limits or because it has no fla kernel at all)
MODELS = {
    "bamba": ("Mamba-2", 'linear_backend = "fla" cannot run the Mamba-2 recurrence here '
              "(cpu, torch.float32, dk=8): it runs on cuda, not cpu"),
    "kimi_linear": ("KDA", 'linear_backend = "fla" cannot run the KDA recurrence here '
                    "(cpu, torch.float32, dk=8): it runs on cuda, not cpu"),
    "lfm2": ("short conv", None),  # no recurrence: linear_backend does not concern it
    "jamba": ("Mamba-1", 'linear_backend = "fla" cannot run the Mamba-1 scan: no fla kernel '
              "is mapped for it"),
}  # fmt: skip


def _swapped(model_type):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build(model_type, HYBRID[model_type])
    assert usp_hf.swap_linear_attention(model, None) >= 1
    return model


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_forced_kernels_that_cannot_run_are_named_at_set_up(model_type):
    kind, recurrence = MODELS[model_type]
    model = _swapped(model_type)
    for chosen in ("auto", "torch"):
        plan = usp.Plan(None, linear_backend=chosen, linear_conv_backend=chosen)
        assert kernel_problem(model, plan, CPU) is None
    problem = kernel_problem(model, usp.Plan(None, linear_backend="fla"), CPU)
    if recurrence is None:
        assert problem is None
    else:
        assert problem.startswith(f"its {kind} layers: {recurrence}"), problem
        assert 'set linear_backend = "auto"' in problem, problem
    problem = kernel_problem(model, usp.Plan(None, linear_conv_backend="causal_conv1d"), CPU)
    assert problem.startswith(
        f'its {kind} layers: linear_conv_backend = "causal_conv1d" cannot run the {kind} conv '
        "here (cpu, torch.float32, "
    ), problem
    assert "it needs causal-conv1d" in problem and 'or "torch"' in problem, problem
