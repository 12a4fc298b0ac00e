"""One row of ``benchmarks/peers.py`` measured (times, memory, bytes, efficiency against
a monolithic reference) and the rows as Markdown tables."""

from __future__ import annotations

import traceback
from dataclasses import asdict

import torch
import torch.nn.functional as F

import usp
from benchmarks import emulate
from benchmarks.collectives import count_passes, total_sent
from benchmarks.peer_cases import (
    CASES,
    MB,
    Peer,
    PeerUnavailable,
    Setup,
    bhsd_inputs,
    bshd_inputs,
    expand_kv,
    first_line,
    grads_of,
    import_optional,
    sdpa_backend,
)
from usp.kernels import BackendUnavailableError


# ------------------------------------------------------------------ measuring
def measure(peer: Peer, setup: Setup) -> dict:
    """Run one peer as rank 0 of a fake world of ``setup.sp`` ranks."""
    with emulate.fake_world(setup.sp, 0, setup.device), CASES[peer.name](peer, setup) as case:
        times = emulate.time_passes(
            case.forward,
            case.backward,
            warmup=setup.warmup,
            repeats=setup.repeats,
            device=setup.device,
        )
        counted = count_passes(case)
        peak = emulate.peak_memory(lambda: case.backward(case.forward()), setup.device)
    return {
        "fwd_ms": times["forward"] * 1e3,
        "bwd_ms": times["backward"] * 1e3,
        "fwd_bwd_ms": times["forward_backward"] * 1e3,
        "peak_mem_bytes": peak,
        **counted,
        "notes": case.notes,
    }


def monolithic_passes(reference: str, setup: Setup, seqlen: int):
    """(forward, backward) of one attention call over ``seqlen`` tokens of the kernel class
    ``reference`` ("usp:<backend>", "sdpa:<backend>" or "flash-attn")."""
    s = setup.shape
    family, _, kernel = reference.partition(":")
    if family == "usp":
        q, k, v, dout = (t.detach() for t in bshd_inputs(setup, seqlen))

        def forward():
            return usp.kernels.attention_forward(q, k, v, causal=True, backend=kernel)

        def backward(out_lse):
            out, lse = out_lse
            return usp.kernels.attention_backward(
                dout, q, k, v, out, lse, causal=True, backend=kernel
            )

        return forward, backward
    if family == "sdpa":
        from torch.nn.attention import sdpa_kernel

        backend = sdpa_backend(kernel)
        q, k, v, dout = bhsd_inputs(setup, seqlen)
        groups = s.heads // s.kv_heads

        def forward():
            with sdpa_kernel(backend):
                kx, vx = expand_kv(k, groups), expand_kv(v, groups)
                return F.scaled_dot_product_attention(q, kx, vx, is_causal=True)

        return forward, grads_of([q, k, v], dout)
    if family == "flash-attn":
        flash_attn = import_optional("flash_attn", "flash-attn")
        q, k, v, dout = bshd_inputs(setup, seqlen)
        return lambda: flash_attn.flash_attn_func(q, k, v, causal=True), grads_of([q, k, v], dout)
    raise ValueError(f"unknown reference kernel {reference!r}")


def monolithic(reference: str, setup: Setup) -> dict:
    """Monolithic forward + backward time for the whole sequence: measured at the full
    length, or at the largest power-of-two fraction within ``max_monolithic_tokens`` (and
    memory) and scaled by (S / measured)^2 (attention FLOPs are quadratic in S)."""
    measured = setup.seqlen
    while measured > setup.max_monolithic_tokens and measured % 2 == 0:
        measured //= 2
    while True:
        try:
            forward, backward = monolithic_passes(reference, setup, measured)
            seconds = emulate.time_passes(
                forward,
                backward,
                warmup=1,
                repeats=setup.monolithic_repeats,
                device=setup.device,
            )["forward_backward"]
            break
        except torch.cuda.OutOfMemoryError:
            if measured % 2 or measured <= 1024:
                raise
            measured //= 2
            torch.cuda.empty_cache()
        except (PeerUnavailable, BackendUnavailableError) as err:
            return {"reference": reference, "ms": None, "note": f"{reference}: {err}"}
        except Exception as err:
            traceback.print_exc()
            note = f"{reference} failed: {first_line(err)}"
            return {"reference": reference, "ms": None, "note": note, "failed": True}
    scale = (setup.seqlen / measured) ** 2
    where = (
        f"at full length {measured}"
        if measured == setup.seqlen
        else f"at {measured} tokens, scaled x{scale:g} (quadratic)"
    )
    return {"reference": reference, "ms": seconds * scale * 1e3, "note": f"{reference} {where}"}


def run_peer(peer: Peer, setup: Setup, references: dict) -> dict:
    """One row: measured, skipped (with the reason) or failed (with the error)."""
    row = {**asdict(peer), "label": peer.label(), "rank": 0, "status": "ok", "reason": None}
    try:
        row.update(measure(peer, setup))
    except PeerUnavailable as err:
        row.update(status="skipped", reason=str(err))
        return row
    except Exception as err:
        traceback.print_exc()
        row.update(status="failed", reason=first_line(err))
        return row
    finally:
        if setup.device.type == "cuda":
            torch.cuda.empty_cache()
    if peer.reference not in references:
        references[peer.reference] = monolithic(peer.reference, setup)
    ref = references[peer.reference]
    s = setup.shape
    flops = emulate.attention_flops(setup.batch, setup.seqlen, s.heads, s.head_dim, True)
    ideal = None if ref["ms"] is None else ref["ms"] / setup.sp
    row.update(
        monolithic_ms=ref["ms"],
        monolithic_note=ref["note"],
        ideal_ms=ideal,
        efficiency=None if ideal is None else ideal / row["fwd_bwd_ms"],
        tflops_per_rank=flops / setup.sp / (row["fwd_bwd_ms"] / 1e3) / 1e12,
        bytes_sent=total_sent(row["traffic"]),
    )
    if row["comm_stats"] is not None:
        row["comm_stats_agree"] = row["comm_stats"] == row["traffic"]
    if ref.get("failed"):  # the row ran, but its efficiency cannot be trusted: say so loudly
        row.update(status="failed", reason=f"monolithic reference: {ref['note']}")
    return row


# ------------------------------------------------------------------ reporting
def fmt(value, spec: str = ".3g") -> str:
    return "n/a" if value is None else format(value, spec)


def setup_text(setup: Setup, rows: list[dict]) -> str:
    s = setup.shape
    device = torch.cuda.get_device_name(setup.device) if setup.device.type == "cuda" else "CPU"
    notes = sorted({r["monolithic_note"] for r in rows if r.get("monolithic_note")})
    lines = [
        f"torch {torch.__version__}, {device}, {setup.dtype}, causal, {setup.preset} heads "
        f"(H={s.heads}, Hkv={s.kv_heads}, D={s.head_dim}), batch {setup.batch}, "
        f"{setup.seqlen} tokens on P={setup.sp} ranks ({setup.local_len} per rank); "
        f"rank 0 of a fake process group (every peer balances causal work: zigzag / "
        f"head-tail); median of {setup.repeats} after {setup.warmup} warm-up",
        "monolithic references (one call over the whole sequence, same kernel class): "
        + ("; ".join(notes) or "none measured"),
        "bytes: counted at the collectives each peer issues (send, all-to-all, all-gather, "
        "reduce-scatter; the part a rank keeps is not counted); no data moves under the "
        "fake backend, so no time is spent communicating",
    ]
    if setup.device.type != "cuda":
        lines.append("CPU run: the times say nothing about GPUs (tiny sizes, shared cores)")
    return "\n".join(lines)


def compute_table(rows: list[dict]) -> str:
    lines = [
        "| peer | u x r | variant | kernel | fwd ms | fwd+bwd ms | TFLOP/s/rank "
        "| monolithic/P ms | efficiency | peak GiB | sent MB | status |",
        "|" + "---|" * 12,
    ]
    for i, r in enumerate(rows, 1):
        ok = r["status"] == "ok"
        status = "ok" if ok else f"{r['status']} [{i}]"
        peak = r.get("peak_mem_bytes")
        lines.append(
            f"| {r['name']} | {r['ulysses']} x {r['ring']} | {r['variant']} | {r['kernel']} "
            f"| {fmt(r.get('fwd_ms'))} | {fmt(r.get('fwd_bwd_ms'))} "
            f"| {fmt(r.get('tflops_per_rank'))} | {fmt(r.get('ideal_ms'))} "
            f"| {fmt(r.get('efficiency'), '.1%')} "
            f"| {fmt(None if peak is None else peak / emulate.GIB)} "
            f"| {fmt(None if not ok else r['bytes_sent'] / MB, '.4g')} | {status} |"
        )
    return "\n".join(lines)


def traffic_table(rows: list[dict]) -> str:
    lines = [
        "| peer | u x r | variant | kernel | pass | kind | calls | sent MB | received MB |",
        "|" + "---|" * 9,
    ]
    for r in rows:
        if r["status"] != "ok":
            continue
        for phase, kinds in r["traffic"].items():
            for kind, c in sorted(kinds.items()):
                lines.append(
                    f"| {r['name']} | {r['ulysses']} x {r['ring']} | {r['variant']} "
                    f"| {r['kernel']} | {phase} | {kind} | {c['calls']} "
                    f"| {c['sent'] / MB:.4g} | {c['received'] / MB:.4g} |"
                )
    return "\n".join(lines)


def notes_text(rows: list[dict]) -> str:
    lines = []
    for i, r in enumerate(rows, 1):
        if r["status"] != "ok":
            lines.append(f"[{i}] {r['label']}: {r['status']}: {r['reason']}")
            continue
        extra = list(r["notes"])
        if r.get("comm_stats") is not None:
            extra.append(
                "usp's comm_stats equal the intercepted bytes"
                if r["comm_stats_agree"]
                else f"usp's comm_stats DIFFER from the intercepted bytes: {r['comm_stats']}"
            )
        if r["unrecognised_collectives"]:
            extra.append(f"not counted: {', '.join(r['unrecognised_collectives'])}")
        lines.append(f"- {r['label']}: " + "; ".join(extra))
    return "\n".join(lines)


def markdown(setup: Setup, rows: list[dict]) -> str:
    return "\n\n".join(
        [
            setup_text(setup, rows),
            "### One rank, side by side",
            compute_table(rows),
            "### Traffic per rank",
            traffic_table(rows),
            "### Notes",
            notes_text(rows),
        ]
    )
