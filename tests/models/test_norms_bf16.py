"""The models' norms in bfloat16 against transformers' own modules, bit for bit: Gemma 3's
and Qwen3.5's zero-centred RMSNorm (``x / rms(x) * (1 + weight)``: the ``1 + weight`` in
float32, rounded once at the end), Qwen3.5's gated RMSNorm of its Gated DeltaNet layers,
Llama's RMSNorm (cast back before the weight), each on trained-looking weights (not the
initial 0 or 1, where the rounding of ``1 + weight`` cannot show). The float64 family
tests cannot see a norm computed in the weight's dtype; bf16 training can.

The modules are reached by their HF names (``model.layers.0.input_layernorm``, ...), which
usp's models share with transformers'.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import usp.models  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


def _write(family: str, directory):
    import trainer_cases

    return trainer_cases.write_checkpoint(directory, family)


#: per family, the norm modules compared (HF names under the causal LM)
NORMS = {
    "gemma3": ["model.layers.0.input_layernorm", "model.layers.0.pre_feedforward_layernorm",
               "model.layers.0.self_attn.q_norm", "model.norm"],
    "qwen3_5": ["model.layers.0.input_layernorm", "model.layers.0.linear_attn.norm",
                "model.layers.1.self_attn.k_norm", "model.norm"],
    "llama": ["model.layers.0.input_layernorm", "model.norm"],
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(NORMS))
def test_norms_in_bfloat16_equal_transformers_bit_for_bit(family, tmp_path):
    directory = _write(family, tmp_path / family)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.bfloat16, use_kernels=False
    )
    ours = usp.models.from_pretrained(directory, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    for name in NORMS[family]:
        a, b = ours.get_submodule(name), theirs.get_submodule(name)
        weight = (0.3 * torch.randn(a.weight.shape, generator=gen)).to(torch.bfloat16)
        if family == "llama" or name.endswith("linear_attn.norm"):  # weight around 1
            weight = (1 + weight.float()).to(torch.bfloat16)
        with torch.no_grad():
            a.weight.copy_(weight)
            b.weight.copy_(weight)
        x = (4 * torch.randn(2, 5, a.weight.shape[0], generator=gen)).to(torch.bfloat16)
        if name.endswith("linear_attn.norm"):  # the gated norm: x and the gate
            gate = torch.randn(x.shape, generator=gen).to(torch.bfloat16)
            got, want = a(x, gate), b(x, gate)
        else:
            got, want = a(x), b(x)
        assert got.dtype == want.dtype == torch.bfloat16, name
        assert torch.equal(got, want), (name, (got.float() - want.float()).abs().max())
