"""The planner's traffic of the linear mixers beside Gated DeltaNet (issue 57): one dispatch
by mixer name (``usp.planner.traffic.linear_traffic``) to the formulas of
``usp.planner.mixer_traffic`` (each asserted against ``CommStats`` on 4 gloo ranks in its
mixer's test: test_mamba2_usp, test_kda_usp, test_short_conv_usp, test_mamba1_usp), and a
step's sum over layers of several mixers."""

from __future__ import annotations

import pytest

from usp.planner import mixer_traffic
from usp.planner.traffic import gdn_traffic, linear_traffic, step_traffic

COMMON = dict(batch=1, seqlen=4096, ulysses=2, ring=4, layout="zigzag", documents=1)
SHAPES = {
    "gated_deltanet": (gdn_traffic, dict(key_heads=2, heads=4, key_dim=8, value_dim=8, kernel=4,
                                         item_bytes=2, gate_bytes=4, state_bytes=4)),
    "kda": (mixer_traffic.kda_traffic, dict(key_heads=4, heads=4, key_dim=8, value_dim=8, kernel=4,
                                            item_bytes=2, gate_bytes=4, state_bytes=4)),
    "mamba2": (mixer_traffic.mamba2_traffic, dict(heads=8, head_dim=16, groups=1, state_size=16,
                                                  kernel=4, item_bytes=2, state_bytes=4)),
    "short_conv": (mixer_traffic.short_conv_traffic, dict(channels=64, kernel=3, item_bytes=2,
                                                          state_bytes=4)),
    "mamba1": (mixer_traffic.mamba1_traffic, dict(channels=64, state_size=16, item_bytes=2,
                                                  state_bytes=4)),
}  # fmt: skip


@pytest.mark.parametrize("mixer", sorted(SHAPES))
def test_the_dispatch_reaches_each_formula(mixer):
    formula, shape = SHAPES[mixer]
    traffic = linear_traffic(mixer, **COMMON, **shape)
    assert traffic == formula(**COMMON, **shape)
    forward, backward = traffic["forward"], traffic["backward"]
    # u2 x r4: both parts; the backward moves what the forward does
    assert forward["all_to_all"]["sent"] == backward["all_to_all"]["sent"] > 0
    assert forward["all_gather"]["sent"] == backward["reduce_scatter"]["sent"] > 0
    single = linear_traffic(mixer, **{**COMMON, "ulysses": 1, "ring": 1}, **shape)
    assert single == {"forward": {}, "backward": {}}  # one rank: nothing moves


def test_an_unknown_mixer_is_refused_by_name():
    with pytest.raises(ValueError, match="no traffic formula for the linear mixer 'rwkv'"):
        linear_traffic("rwkv", **COMMON)


def test_a_step_adds_every_mixer_kind():
    mamba = linear_traffic("mamba2", **COMMON, **SHAPES["mamba2"][1])
    conv = linear_traffic("short_conv", **COMMON, **SHAPES["short_conv"][1])
    sent = step_traffic({}, {}, layers=0, micro_batches=2, recompute=True,
                        mixers=[(mamba, 3), (conv, 5)])  # fmt: skip
    for kind, direction in (("all_to_all", "forward"), ("all_gather", "forward"),
                            ("reduce_scatter", "backward")):  # fmt: skip
        passes = 2 if direction == "forward" else 1  # the recompute runs the forward again
        expected = sum(
            t[direction].get(kind, {}).get("sent", 0) * passes * layers * 2
            for t, layers in ((mamba, 3), (conv, 5))
        )
        if kind == "all_to_all":  # the backward's all-to-alls too
            expected += sum(t["backward"]["all_to_all"]["sent"] * layers * 2
                            for t, layers in ((mamba, 3), (conv, 5)))  # fmt: skip
        assert sent[f"linear_{kind}"] == expected, kind
