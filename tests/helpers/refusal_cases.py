"""The refusal pattern of the linear mixers' distributed tests: every bad call raises the
same usp error on every rank, before any byte moves."""

from __future__ import annotations


def refusal_messages(calls: dict, stats) -> dict[str, str]:
    """Each of ``calls`` (name -> a call that should raise) run in turn on this rank:
    ``"Type: message"`` (or ``"no error"``) by name. Asserts that none sent a byte
    (``stats``: the topology's ``comm_stats``, reset before each call)."""
    messages = {}
    for name, call in calls.items():
        stats.reset()
        try:
            call()
            messages[name] = "no error"
        except Exception as err:  # noqa: BLE001 - the tests compare type and text
            messages[name] = f"{type(err).__name__}: {err}"
        assert stats.total_sent == 0, (name, stats.snapshot())
    return messages


def assert_same_refusals(per_rank: list[dict[str, str]], expected: dict[str, tuple]) -> None:
    """Every name of ``expected`` raised one message on every rank, holding each of its
    parts."""
    for name, parts in expected.items():
        messages = {messages[name] for messages in per_rank}
        assert len(messages) == 1, f"{name}: ranks raised different errors: {messages}"
        message = messages.pop()
        for part in parts:
            assert part in message, message
