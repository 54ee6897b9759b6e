"""The AMX tile state request (real ``arch_prctl`` calls: on a CPU without AMX, supported and
permitted are both false and the request does nothing)."""

from __future__ import annotations

import errno
import json
import logging
import subprocess
import sys

import pytest

from omni_trio.backends.vllm import amx as _amx
from omni_trio.backends.vllm.amx import AmxState, amx_state, request_amx, request_amx_or_warn


def test_a_request_leaves_amx_permitted_exactly_where_it_is_supported() -> None:
    state = request_amx()
    assert state == amx_state()
    assert state.permitted == state.supported
    assert request_amx() == state  # asking again changes nothing


@pytest.mark.slow  # a subprocess
def test_a_new_program_holds_no_permission_until_it_asks() -> None:
    # exec drops the permission: every process vLLM spawns must ask for itself
    code = (
        "import json; from omni_trio.backends.vllm.amx import amx_state, request_amx; "
        "b = amx_state(); a = request_amx(); "
        "print(json.dumps([b.supported, b.permitted, a.supported, a.permitted]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    supported, permitted_before, supported_after, permitted_after = json.loads(out.stdout)
    assert permitted_before is False
    assert supported_after == supported
    assert permitted_after == supported


def test_a_refused_request_is_a_warning_and_the_process_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse() -> AmxState:
        raise OSError(errno.ENOSPC, "arch_prctl(0x1023): No space left on device")

    monkeypatch.setattr(_amx, "request_amx", refuse)
    logger = logging.getLogger("test_amx.refused")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        assert request_amx_or_warn(logger) is None
    finally:
        logger.removeHandler(handler)
    (record,) = records
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert "refused AMX tile state" in message and "No space left on device" in message
    assert "SIGILL" in message
