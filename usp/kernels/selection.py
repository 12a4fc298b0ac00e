"""Which backend runs a call: a named one (if it can), or ``auto``'s fastest that can.

A backend can run a call when its stated limits allow it (``Backend.limits_reason``) and
it passed its run-time self-check there (``usp.kernels.selfcheck``). ``auto`` says
(``usp.kernels`` logger, a warning for a failed backend) what it skipped, once per
process and reason.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import TypeVar

from usp.kernels.backends import registry
from usp.kernels.backends.base import Backend, BackendFailure
from usp.kernels.backends.registry import KernelRegistry
from usp.kernels.selfcheck import spec_verdict
from usp.kernels.spec import AttentionInputError, AttentionSpec, BackendUnavailableError
from usp.options import AUTO_BACKEND

logger = logging.getLogger("usp.kernels")
K = TypeVar("K")

#: Off the CPU, ``auto`` falls back to ``math`` only for calls of at most this many
#: scores (B * H * Sq * Sk; for packed calls Tq * Tk bounds the per-document ones).
#: ``math`` materialises them in float32, several copies in the backward: 2**24 scores
#: are 64 MiB a copy. Beyond it ``auto`` raises (listing why every backend was refused)
#: instead of running out of memory, or crawling, at long lengths; ``backend="math"``
#: still forces it.
MATH_AUTO_MAX_SCORES = 2**24

# (kind, kernel, reason) triples already reported by ``auto`` (:func:`report_auto_skip`:
# attention backends, and usp.linear's GDN and conv kernels): each once per process.
_reported_skips: set[tuple[str, str, str]] = set()


def unsupported_reason(impl: Backend, spec: AttentionSpec) -> str | None:
    """None if ``impl`` can run the call here: its stated limits, then (for self-checked
    backends) its cached self-check verdict; else the reason (a :class:`BackendFailure`
    when it should have been able to)."""
    reason = impl.limits_reason(spec)
    if reason is None and impl.self_checked:
        reason = impl.vet(spec, spec_verdict)
    return reason


def select_backend(
    spec: AttentionSpec, backend: str = "auto", kernels: KernelRegistry | None = None
) -> Backend:
    """The backend that will run a call: the named one, or the fastest that supports it.
    ``kernels``: the registry the names are looked up in (default: usp's).

    Runs no kernel except a backend's one-time self-check, so callers can use it to
    validate a call before any communication. Raises AttentionInputError for an unknown
    name and BackendUnavailableError (with every backend's reason) when nothing fits.
    """
    kernels = registry.DEFAULT if kernels is None else kernels
    order = registry.auto_order(spec.device)
    if spec.varlen:  # native varlen kernels first; others loop over documents
        order = sorted(order, key=lambda name: not kernels.get(name).supports_varlen)

    def able() -> str:
        names = [
            n for n in registry.BACKEND_NAMES if unsupported_reason(kernels.get(n), spec) is None
        ]
        return f"Backends that can: {', '.join(names) or 'none'}"

    return choose(
        backend, registry.BACKEND_NAMES, kernels.get,
        lambda name, impl: _auto_reason(name, spec, kernels) if backend == "auto"
        else unsupported_reason(impl, spec),
        order=order, kind="attention backend", call=_describe(spec), log=logger,
        unknown=AttentionInputError, unable=BackendUnavailableError, fix=able,
    )  # fmt: skip


def choose(
    requested: str,
    names: Sequence[str],
    get: Callable[[str], K],
    reason_of: Callable[[str, K], str | None],
    *,
    kind: str,
    call: str,
    log: logging.Logger,
    unknown: type[Exception],
    unable: type[Exception],
    fix: Callable[[], str],
    order: Sequence[str] | None = None,
) -> K:
    """The one way usp picks a kernel (attention backends, the linear mixers' recurrence
    and conv kernels): ``requested`` is ``"auto"`` or one of ``names``; ``get`` gives a
    name's kernel; ``reason_of(name, kernel)`` says why it cannot run the call (its stated
    limits, then its cached self-check verdict), or None.

    ``auto`` takes the first of ``order`` (default ``names``) that can, and says once per
    process what it passed over (:func:`report_auto_skip`: logged; a
    :class:`BackendFailure` warned about too); when none can it raises ``unable`` with
    every reason. A named kernel that cannot run raises ``unable`` with its reason and
    ``fix()`` (what to choose instead); an unknown name raises ``unknown``. ``kind``
    ("GDN kernel") and ``call`` ("this call (cpu, torch.float32, dk=8)") word the
    messages. Callers raise inside their checks, so the SP ranks agree on the refusal
    before the first collective (:mod:`usp.comm.agreement`)."""
    if requested == AUTO_BACKEND:
        skipped: list[tuple[str, str]] = []
        for name in names if order is None else order:
            kernel = get(name)
            reason = reason_of(name, kernel)
            if reason is None:
                for passed, why in skipped:
                    report_auto_skip(kind, passed, why, name, log, context=call, stacklevel=4)
                return kernel
            skipped.append((name, reason))
        raise unable(f"no {kind} can run {call}. " + "; ".join(f"{n}: it {r}" for n, r in skipped))
    if requested not in names:
        raise unknown(f"unknown {kind} {requested!r}; valid: {', '.join((AUTO_BACKEND, *names))}")
    kernel = get(requested)
    reason = reason_of(requested, kernel)
    if reason is not None:
        raise unable(f"{kind} {requested!r} cannot run {call}: it {reason}. {fix()}")
    return kernel


def _auto_reason(name: str, spec: AttentionSpec, kernels: KernelRegistry) -> str | None:
    reason = unsupported_reason(kernels.get(name), spec)
    if reason is None and name == "math" and spec.device.type != "cpu":
        scores = spec.batch * spec.num_heads * spec.seqlen_q * spec.seqlen_k
        if scores > MATH_AUTO_MAX_SCORES:
            reason = (
                f"would materialise {scores} float32 scores (B*H*Sq*Sk) on "
                f"{spec.device.type}; auto falls back to it there only up to "
                f"{MATH_AUTO_MAX_SCORES} (backend='math' forces it)"
            )
    return reason


def report_auto_skip(
    what: str, name: str, reason, chosen: str, log: logging.Logger, context: str = "",
    stacklevel: int = 2,
) -> None:  # fmt: skip
    """Say once per process (not once per layer and ring step) that ``auto`` passed over
    kernel ``name`` (a ``what``: attention backend, GDN kernel, conv kernel) for
    ``chosen``: logged, and for a :class:`BackendFailure` (it should have been able to)
    warned about too; a plain limit is only logged at info. ``stacklevel`` is the
    warning's, counted from the caller."""
    key = (what, name, str(reason))
    if key in _reported_skips:
        return
    _reported_skips.add(key)
    message = f"{what} {name!r} skipped by auto: it {reason}; using {chosen!r}"
    logged = f"{message} ({context})" if context else message
    if isinstance(reason, BackendFailure):
        log.warning("%s", logged)
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)
    else:
        log.info("%s", logged)


def _describe(spec: AttentionSpec) -> str:
    window = f", window={spec.window}" if spec.window is not None else ""
    varlen = ", packed" if spec.varlen else ""
    return (
        f"this call ({spec.device.type}, {spec.dtype}, batch={spec.batch}, "
        f"Sq={spec.seqlen_q}, Sk={spec.seqlen_k}, head_dim={spec.head_dim}, "
        f"heads={spec.num_heads}/{spec.num_kv_heads}, causal={spec.causal}{window}{varlen})"
    )
