"""The TrainingService for any caller: a plain script (`BlockingService`) and trio or any other anyio event loop
(`AnyioService`), besides asyncio's own `await TrainingService...as_service(...)`.

    with TrainingService.options(nproc=2).as_blocking_service("gpt", model_args=...) as service:
        service.forward_backward(batch); service.optim_step()

    async with await TrainingService.options(nproc=2).as_anyio_service("gpt", ...) as service:   # under trio
        await service.forward_backward(batch); await service.optim_step()

Both run the one asyncio `TrainingService` on an event loop of its own, in a daemon thread (`ServiceLoop`), and
hand each call to it. Why a thread rather than a second implementation on anyio: the service's sockets, heartbeats
and failure monitor keep running while the caller's thread computes (an RL loop scoring rollouts, a script between
calls), so a worker's death is seen when it happens, not at the caller's next await; and there is one service to
test. Results and errors (`WorkerFailure`, `WorkersRestarted`, `RemoteError`) come back to the caller as raised by
the service. Cancelling an anyio call (a trio cancel scope) abandons the wait; the call itself runs to its end in
the service's loop, as a call on the wire cannot be taken back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any


class ServiceLoop:
    """An asyncio event loop running on a daemon thread of its own."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="disttrain-service", daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        """Stop the loop and end its thread; from any thread, the loop's own included (it then ends afterwards)."""
        if threading.current_thread() is self._thread:
            threading.Thread(target=self.close, daemon=True).start()
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class _OnALoop:
    """A `TrainingService` started on a `ServiceLoop`; `_submit` runs one of its coroutine methods there."""

    def __init__(self, loop: ServiceLoop, service):
        self._loop, self.service = loop, service

    @classmethod
    def _start(cls, options, args: tuple, kwargs: dict) -> concurrent.futures.Future:
        """Start the service on a new loop; the future's result is the `cls` holding it (the loop is closed again
        when the start fails)."""
        loop = ServiceLoop()
        started: concurrent.futures.Future = concurrent.futures.Future()

        def done(future: concurrent.futures.Future) -> None:
            if future.exception() is not None:
                loop.close()
                started.set_exception(future.exception())
            else:
                started.set_result(cls(loop, future.result()))

        loop.submit(options.as_service(*args, **kwargs)).add_done_callback(done)
        return started

    def _submit(self, name: str, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        return self._loop.submit(getattr(self.service, name)(*args, **kwargs))

    def _shutdown(self) -> None:
        """Shut the service down and end the loop's thread (blocking: the caller's thread, or anyio's)."""
        try:
            self._submit("shutdown").result()
        finally:
            self._loop.close()


class BlockingService(_OnALoop):
    """The TrainingService for plain scripts: each method blocks until its call returns (see the module doc)."""

    def forward_backward(self, batch: Any, loss_fn: str | None = None, *, sync: bool = True) -> dict[str, Any]:
        return self._submit("forward_backward", batch, loss_fn, sync=sync).result()

    def optim_step(self) -> dict[str, Any]:
        return self._submit("optim_step").result()

    def forward(self, batch: Any) -> Any:
        return self._submit("forward", batch).result()

    def call(self, fn: str, batch: Any = None, **kwargs: Any) -> list[Any]:
        return self._submit("call", fn, batch, **kwargs).result()

    def save(self, path=None, metrics: dict[str, float] | None = None) -> str:
        return self._submit("save", path, metrics).result()

    def load(self, path=None, step: int | str = "latest") -> int:
        return self._submit("load", path, step).result()

    def state_dict(self) -> dict:
        return self._submit("state_dict").result()

    def status(self) -> dict[str, Any]:
        return self._submit("status").result()

    def shutdown(self) -> None:
        self._shutdown()

    def __enter__(self) -> BlockingService:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


async def await_future(future: concurrent.futures.Future) -> Any:
    """The result of `future` (a call on the service's loop), awaited from any anyio event loop: a worker thread of
    anyio's waits for it, so the caller's loop runs on meanwhile."""
    import anyio

    return await anyio.to_thread.run_sync(future.result, abandon_on_cancel=True)


class AnyioService(_OnALoop):
    """The TrainingService for trio, or asyncio through anyio: each method awaits its call (see the module doc)."""

    async def forward_backward(self, batch: Any, loss_fn: str | None = None, *, sync: bool = True) -> dict[str, Any]:
        return await await_future(self._submit("forward_backward", batch, loss_fn, sync=sync))

    async def optim_step(self) -> dict[str, Any]:
        return await await_future(self._submit("optim_step"))

    async def forward(self, batch: Any) -> Any:
        return await await_future(self._submit("forward", batch))

    async def call(self, fn: str, batch: Any = None, **kwargs: Any) -> list[Any]:
        return await await_future(self._submit("call", fn, batch, **kwargs))

    async def save(self, path=None, metrics: dict[str, float] | None = None) -> str:
        return await await_future(self._submit("save", path, metrics))

    async def load(self, path=None, step: int | str = "latest") -> int:
        return await await_future(self._submit("load", path, step))

    async def state_dict(self) -> dict:
        return await await_future(self._submit("state_dict"))

    async def status(self) -> dict[str, Any]:
        return await await_future(self._submit("status"))

    async def shutdown(self) -> None:
        import anyio

        await anyio.to_thread.run_sync(self._shutdown)

    async def __aenter__(self) -> AnyioService:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()
