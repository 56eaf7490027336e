"""EngineServicerBase: what the prefill and decode servicers share (grpc.aio).

The worker lookup (UNAVAILABLE while loading or, for a new request, draining), `Abort` and
`GetState`; each role's servicer adds its own methods and mixes this in before its
generated `*ServiceServicer` base.
"""

from __future__ import annotations

import logging
from typing import Generic, TypeVar

import grpc

from services.common.errors import abort_with
from services.common.server import ServiceRuntime
from services.common.worker import EngineWorker
from shared.proto import engine_pb2 as pb

logger = logging.getLogger(__name__)
W = TypeVar("W", bound=EngineWorker)


class EngineServicerBase(Generic[W]):
    worker_type: type[EngineWorker] = EngineWorker
    """The role's worker class (PrefillWorker, DecodeWorker)."""

    def __init__(self, runtime: ServiceRuntime) -> None:
        self.runtime = runtime

    def _worker(self, new_request: bool = False) -> W:
        """The worker. Raises ServiceError(UNAVAILABLE) while loading (or draining, for a
        new request)."""
        worker = self.runtime.require_worker(new_request)
        assert isinstance(worker, self.worker_type)
        return worker  # type: ignore[return-value]

    async def Abort(self, request: pb.AbortRequest,
                    context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        ids = list(request.request_ids)
        try:
            aborted = await self._worker().abort(ids)
        except Exception as e:
            await abort_with(context, e, ",".join(ids), "Abort")
        for rid in aborted:
            logger.info("[%s] aborted", rid)
        return pb.AbortResponse(aborted_request_ids=aborted)

    async def GetState(self, request: pb.GetStateRequest,
                       context: grpc.aio.ServicerContext) -> pb.EngineState:
        try:
            state = await self._worker().get_state(request.check_invariants)
        except Exception as e:
            await abort_with(context, e, "-", "GetState")
        return pb.EngineState(**state._asdict())
