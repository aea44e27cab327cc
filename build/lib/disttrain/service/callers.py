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
the service's loop, as a call on the wire cannot be taken back; a start abandoned so leaves its service running
until the process ends. Live objects (`model=...`) need `await ...as_service(...)` under asyncio: they reach workers by
forking, which a driver with the service's thread cannot do safely.
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
        """Stop the loop and end its thread (from another thread)."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


def _starting(options, args: tuple, kwargs: dict, entry: str) -> tuple[ServiceLoop, concurrent.futures.Future]:
    """(a new loop, the future of `options.as_service(*args, **kwargs)` on it). Live objects are refused: they reach
    workers by forking, and a driver whose service runs on a thread of its own cannot fork safely."""
    from disttrain.service.fork import ForkUnsafe

    objects = [k for k in ("model", "optimizer", "loss_fn") if kwargs.get(k) is not None
               and not isinstance(kwargs[k], (str, dict))]
    if objects or (len(args) > 2 and callable(args[2])):
        raise ForkUnsafe(f"{entry}: objects ({', '.join(objects) or 'loss_fn'}) reach workers by forking the driver, "
                         "which cannot be done safely while the service runs on a thread of its own; use `await "
                         "TrainingService.options(...).as_service(...)` under asyncio, or import paths")
    coro = options.as_service(*args, **kwargs)  # (bad arguments raise here, before any thread starts)
    loop = ServiceLoop()
    return loop, loop.submit(coro)


class _OnALoop:
    """A `TrainingService` started on a `ServiceLoop`; `_call` runs one of its coroutine methods there."""

    def __init__(self, loop: ServiceLoop, service):
        self._loop, self.service = loop, service
        self._closed = False

    def _call(self, name: str, args: tuple, kwargs: dict) -> concurrent.futures.Future:
        if self._closed:
            raise RuntimeError(f"{name}: this service was shut down")
        return self._loop.submit(getattr(self.service, name)(*args, **kwargs))

    def _shutdown(self) -> None:
        """Shut the service down and end the loop's thread (blocking: the caller's thread, or anyio's); again: a
        no-op."""
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.submit(self.service.shutdown()).result()
        finally:
            self._loop.close()


class BlockingService(_OnALoop):
    """The TrainingService for plain scripts: its methods, with the same arguments, each blocking until its call
    returns (see the module doc)."""

    @classmethod
    def start(cls, options, args: tuple, kwargs: dict) -> BlockingService:
        loop, future = _starting(options, args, kwargs, "as_blocking_service")
        try:
            return cls(loop, future.result())
        except BaseException:
            loop.close()
            raise

    def forward_backward(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self._call("forward_backward", args, kwargs).result()

    def optim_step(self) -> dict[str, Any]:
        return self._call("optim_step", (), {}).result()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("forward", args, kwargs).result()

    def call(self, *args: Any, **kwargs: Any) -> list[Any]:
        return self._call("call", args, kwargs).result()

    def save(self, *args: Any, **kwargs: Any) -> str:
        return self._call("save", args, kwargs).result()

    def load(self, *args: Any, **kwargs: Any) -> int:
        return self._call("load", args, kwargs).result()

    def state_dict(self) -> dict:
        return self._call("state_dict", (), {}).result()

    def status(self) -> dict[str, Any]:
        return self._call("status", (), {}).result()

    def shutdown(self) -> None:
        self._shutdown()

    def __enter__(self) -> BlockingService:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _anyio():
    try:
        import anyio
    except ImportError:
        from disttrain.errors import ConfigError

        raise ConfigError("as_anyio_service needs anyio: pip install 'disttrain[trio]'") from None
    return anyio


async def await_future(future: concurrent.futures.Future) -> Any:
    """The result of `future` (a call on the service's loop), awaited from any anyio event loop: a worker thread of
    anyio's waits for it, so the caller's loop runs on meanwhile."""
    return await _anyio().to_thread.run_sync(future.result, abandon_on_cancel=True)


class AnyioService(_OnALoop):
    """The TrainingService for trio, or asyncio through anyio: its methods, with the same arguments, each awaited
    (see the module doc)."""

    @classmethod
    async def start(cls, options, args: tuple, kwargs: dict) -> AnyioService:
        anyio = _anyio()  # (before any worker starts)
        loop, future = _starting(options, args, kwargs, "as_anyio_service")
        try:
            return cls(loop, await await_future(future))
        except BaseException:
            await anyio.to_thread.run_sync(loop.close)
            raise

    async def forward_backward(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return await await_future(self._call("forward_backward", args, kwargs))

    async def optim_step(self) -> dict[str, Any]:
        return await await_future(self._call("optim_step", (), {}))

    async def forward(self, *args: Any, **kwargs: Any) -> Any:
        return await await_future(self._call("forward", args, kwargs))

    async def call(self, *args: Any, **kwargs: Any) -> list[Any]:
        return await await_future(self._call("call", args, kwargs))

    async def save(self, *args: Any, **kwargs: Any) -> str:
        return await await_future(self._call("save", args, kwargs))

    async def load(self, *args: Any, **kwargs: Any) -> int:
        return await await_future(self._call("load", args, kwargs))

    async def state_dict(self) -> dict:
        return await await_future(self._call("state_dict", (), {}))

    async def status(self) -> dict[str, Any]:
        return await await_future(self._call("status", (), {}))

    async def shutdown(self) -> None:
        await _anyio().to_thread.run_sync(self._shutdown)

    async def __aenter__(self) -> AnyioService:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()
