"""pgq.eventloop: pgq's own processes run on uvloop (a dependency where it
builds), or on asyncio's loop when PGQ_EVENT_LOOP=asyncio asks for it."""

from __future__ import annotations

import asyncio
import sys

import pytest

from pgq import eventloop


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


@pytest.mark.skipif(sys.platform == "win32", reason="uvloop has no Windows build")
def test_the_loop_is_uvloop_unless_asyncio_is_asked_for(monkeypatch):
    pytest.importorskip("uvloop")  # a dependency where it builds
    monkeypatch.delenv(eventloop.ENV, raising=False)
    assert eventloop.loop_name() == "uvloop"
    assert eventloop.run(_loop_module) == "uvloop"
    monkeypatch.setenv(eventloop.ENV, "asyncio")
    assert eventloop.loop_name() == "asyncio"
    assert eventloop.run(_loop_module) == "asyncio"


def test_a_loop_that_does_not_import_falls_back_to_asyncio(monkeypatch, caplog):
    # A broken uvloop build must cost speed, not the server.
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    monkeypatch.setenv(eventloop.ENV, "uvloop")
    assert eventloop.loop_name() == "asyncio"
    assert eventloop.run(_loop_module) == "asyncio"
    assert "does not import" in caplog.text
