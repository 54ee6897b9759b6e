"""What the talker backend's engine tests share: an engine bounded by a hang guard, and the
talker replica's state."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

import omni_trio
from omni_trio import Engine


@asynccontextmanager
async def engine_on(cfg: dict) -> AsyncIterator[Engine]:
    with trio.fail_after(180):
        async with omni_trio.open_engine(cfg) as engine:
            yield engine


async def talker_state(engine: Engine) -> dict[str, Any]:
    with trio.fail_after(30):
        (described,) = await engine.collective_rpc("describe", stage_ids=["talker"])
    assert isinstance(described, dict)
    return described
