"""The worker tier: one process (or Ray actor) = one rank, serving commands from a driver over a socket.

A worker connects to the driver, says hello (rank, pid, host, token), then serves one command at a time:

    setup            form the torch process group (the driver hosts its rendezvous store), build the model
                     and optimizer from factories (import paths + JSON arguments) and a TrainingBackend
    forward_backward this rank's slice of the global batch -> {"loss", "count"}
    optim_step       -> the backend's step metrics (identical on every rank)
    forward          this rank's slice -> its outputs
    call             run `pkg.mod:fn(batch)` on this rank's slice (all ranks together: it may use
                     `disttrain.collectives`) -> its result
    save / load      CheckpointManager save / load of the backend state (every rank takes part)
    state_dict       full model weights (rank 0 replies with them)
    weights_*        open / push / close a weight sync to inference engines (weights/)
    shutdown         leave the process group and exit

Every reply carries the command's id; an exception becomes an error reply with its traceback, and the
worker keeps serving. A background thread sends a heartbeat (with the backend's current phase and how long it has
been in it) every `heartbeat_s`, so the driver can tell a dead or stopped process (SIGSTOP, swapped out, frozen
host) from a busy one, and a rank stuck in a training phase (a hang in the user's code, or a collective its peers
never joined) from one that makes progress (group.py). Messages are JSON plus
safetensors (`wire.py`); a frame that is anything else (a pickle) is rejected and the worker exits.

Run directly: `python -m disttrain.service.worker --connect HOST:PORT --rank R --world N` with the token in
the DISTTRAIN_SERVICE_TOKEN environment variable (the local backend does this; Ray actors call `serve`).
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from disttrain.errors import ArgumentParser
from disttrain.monitor import PROBE_AT, CollectiveProbe
from disttrain.service.fork import die_with_parent
from disttrain.service.wire import TIMED_PHASES, TOKEN_ENV, Connection, WireError, pack, split_batch, unpack

log = logging.getLogger(__name__)


def import_object(path: str, setting: str) -> Any:
    """`package.module:name` -> the object; a failure names the setting."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{setting} = {path!r}: expected 'package.module:name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{setting} = {path!r}: cannot import '{module_name}' ({exc}); check PYTHONPATH") from None
    if not hasattr(module, attr):
        raise ValueError(f"{setting} = {path!r}: '{module_name}' has no '{attr}'")
    return getattr(module, attr)


class RankServer:
    """One rank's state and command handlers (see the module docstring)."""

    def __init__(self, conn: Connection, rank: int, world: int, heartbeat_s: float):
        self.conn, self.rank, self.world, self.heartbeat_s = conn, rank, world, heartbeat_s
        self.backend = None
        self.runtime = None
        self.phase = ("idle", time.monotonic())  # (name, since when): one tuple, read whole by the heartbeat
        self.running = True
        self._stop = threading.Event()
        self._loss_fns: dict[str, Callable] = {}
        self.publisher = None  # a weight sync's sending side (weights/)
        self.timeout_s = math.inf  # the service's timeout_s, from setup
        self.probe = CollectiveProbe()
        self.warm = False  # an optimizer step done: the driver's limit is timeout_s from now on (startup before)

    # -- the loop ----------------------------------------------------------------------------------

    def serve(self) -> int:
        beat = threading.Thread(target=self._heartbeat, name="disttrain-heartbeat", daemon=True)
        beat.start()
        try:
            while self.running:
                try:
                    message, tensors = self.conn.recv()
                except WireError as exc:  # never guess at a foreign stream: say why and leave
                    self.conn.send({"op": "rejected", "error": str(exc), "rank": self.rank})
                    log.error("worker %d: %s", self.rank, exc)
                    return 2
                except EOFError:
                    return 0  # the driver is gone
                self._handle(message, tensors)
            return 0
        finally:
            self._stop.set()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                step = self.backend.step if self.backend is not None else 0
                phase, since = self.phase
                beat = {"op": "heartbeat", "rank": self.rank, "phase": phase, "step": step,
                        "in_phase_s": time.monotonic() - since, "warm": self.warm, "time": time.time()}
                if phase in TIMED_PHASES and beat["in_phase_s"] > PROBE_AT * self.timeout_s:  # waiting on a peer?
                    beat["in_collective"] = self.probe((phase, since))  # (the driver names whom others wait for)
                self.conn.send(beat)
            except OSError:
                return

    def _handle(self, message: dict[str, Any], tensors: dict) -> None:
        op, ident = message.get("op"), message.get("id")
        handler = getattr(self, f"op_{op}", None) if isinstance(op, str) else None
        try:
            if handler is None:
                raise ValueError(f"unknown command {op!r}")
            if op != "setup" and op != "shutdown" and self.backend is None:
                raise RuntimeError(f"command {op!r} before setup")
            self._on_phase(op)
            reply, out = handler(message, tensors)
            self.warm = self.warm or op == "optim_step"
            self._on_phase("idle")  # before the reply: no heartbeat after it says the command still runs
            self.conn.send({"id": ident, "ok": True, **reply}, out)
        except Exception as exc:  # reported to the driver, which raises it there
            self._on_phase("idle")
            self.conn.send({"id": ident, "ok": False, "rank": self.rank, "type": type(exc).__name__,
                            "error": str(exc), "traceback": traceback.format_exc()})

    def _on_phase(self, phase: str) -> None:
        self.phase = (phase, time.monotonic())

    # -- commands ----------------------------------------------------------------------------------

    def op_setup(self, msg: dict, tensors: dict) -> tuple[dict, dict | None]:
        import torch

        from disttrain.backend import create_backend
        from disttrain.config import GPU_BOUND_ENV, DistConfig, OptimConfig, ParallelConfig
        from disttrain.optim import optimizer_factory, scheduler_factory
        from disttrain.parallel import registry
        from disttrain.runtime import init_runtime

        for path in reversed(msg.get("sys_path", [])):
            if path not in sys.path:
                sys.path.insert(0, path)
        os.environ.update({
            "RANK": str(self.rank), "WORLD_SIZE": str(self.world), "LOCAL_RANK": str(msg.get("local_rank", 0)),
            "LOCAL_WORLD_SIZE": str(msg.get("local_world_size", 1)), "MASTER_ADDR": msg["store_host"],
            "MASTER_PORT": str(msg["store_port"]), "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": str(msg.get("generation", 0)),  # a fresh key prefix per group
            GPU_BOUND_ENV: "1" if msg.get("gpu_bound") else "0",  # a Ray actor with GPUs of its own
        })
        self.timeout_s = float(msg.get("timeout_s", 300.0))
        dist_cfg = DistConfig(device=msg.get("device", "auto"), timeout_s=self.timeout_s,
                              startup_timeout_s=float(msg.get("startup_timeout_s", 900.0)),
                              threads_per_rank=int(msg.get("threads", 0)))
        parallel = ParallelConfig(**{"strategy": msg.get("strategy", "auto"), "precision": msg.get("precision", "fp32"),
                                     **msg.get("parallel", {})})
        # the group forms before the model is built: a model factory may use it (as under the Trainer)
        spec = registry.resolve(parallel.strategy, self.world)
        from disttrain.parallel.mesh import layout_for

        self.layout = layout_for(parallel, self.world, spec)
        self.runtime = init_runtime(dist_cfg, always_form_group=spec.needs_group)
        torch.manual_seed(int(msg.get("seed", 0)))
        model = self._build_model(msg)
        optim = OptimConfig(**msg.get("optimizer", {}))
        if msg.get("optimizer_fn") == "live:optimizer":
            make_optimizer = _inherited_optimizer(model)
        elif msg.get("optimizer_fn"):
            factory = import_object(msg["optimizer_fn"], "optimizer_fn")
            opt_args = msg.get("optimizer_args", {})
            make_optimizer = (lambda m: factory(m, **opt_args))
        else:
            make_optimizer = optimizer_factory(optim)
        schedule = scheduler_factory(optim, int(msg["total_steps"])) if msg.get("total_steps") else None
        loss_fn = self._loss_fn(msg.get("loss_fn"))
        self.backend = create_backend(model, make_optimizer, parallel, runtime=self.runtime, scheduler_factory=schedule,
                                      grad_clip=float(msg.get("grad_clip", optim.grad_clip)), loss_fn=loss_fn,
                                      on_nonfinite=msg.get("on_nonfinite", "stop"))
        self.backend.on_phase = self._on_phase
        params = sum(p.numel() for p in self.backend.model.parameters())
        return {"rank": self.rank, "device": str(self.runtime.device), "parameters": params}, None

    def _build_model(self, msg: dict):
        from torch import nn

        name, args = msg["model_fn"], msg.get("model_args", {})
        if name == "live:model":  # forked from the driver, which built it (fork.py)
            from disttrain.service.fork import inherited

            model = inherited("model")
            model = model if isinstance(model, nn.Module) else model(**args)
        elif name == "gpt":
            from disttrain.config import ModelConfig
            from disttrain.models.gpt import GPT

            model = GPT(ModelConfig(**args))
        elif name.startswith("hf:"):  # a local HF model directory; sharded strategies start sharded
            from disttrain.models.hf import load_pretrained

            model = load_pretrained(name)
        else:
            model = import_object(name, "model_fn")(**args)
        if not isinstance(model, nn.Module):
            raise TypeError(f"model_fn = {name!r} returned {type(model).__name__}, not a torch.nn.Module")
        return model

    def _loss_fn(self, path: str | None):
        if not path:
            return None
        if path == "live:loss_fn":
            from disttrain.service.fork import inherited

            return inherited("loss_fn")
        if path not in self._loss_fns:
            self._loss_fns[path] = import_object(path, "loss_fn")
        return self._loss_fns[path]

    def op_forward_backward(self, msg: dict, tensors: dict) -> tuple[dict, None]:
        """This rank's slice in `micro_batches` pieces (the driver sends every rank the same number, so
        collectives pair up), gradients reduced on the last one only, if `sync`: a whole optimizer step's
        accumulation costs one round trip."""
        batch, loss_fn, sync = unpack(msg["batch"], tensors), self._loss_fn(msg.get("loss_fn")), msg.get("sync", True)
        micro = split_batch(batch, int(msg.get("micro_batches") or 1), allow_empty=True)
        loss_sum = count = 0.0
        for i, part in enumerate(micro):
            metrics = self.backend.forward_backward(part, loss_fn, sync=sync and i == len(micro) - 1)
            loss_sum += metrics["loss"] * metrics["count"]
            count += metrics["count"]
        return {"metrics": {"loss": loss_sum / max(count, 1.0), "count": count, "micro_batches": len(micro)}}, None

    def op_optim_step(self, msg: dict, tensors: dict) -> tuple[dict, None]:
        return {"metrics": self.backend.optim_step()}, None

    def op_forward(self, msg: dict, tensors: dict) -> tuple[dict, dict]:
        skeleton, out = pack(self.backend.forward(unpack(msg["batch"], tensors)), "out")
        return {"result": skeleton}, out

    def op_call(self, msg: dict, tensors: dict) -> tuple[dict, dict]:
        fn = import_object(msg["fn"], "fn")
        skeleton, out = pack(fn(unpack(msg["batch"], tensors), **msg.get("kwargs", {})), "out")
        return {"result": skeleton}, out

    def _manager(self, msg: dict):
        from disttrain.checkpoint import CheckpointManager
        from disttrain.config import CheckpointConfig

        cfg = CheckpointConfig(keep_last=int(msg.get("keep_last", 3)))
        return CheckpointManager(Path(msg["path"]), cfg, self.runtime,
                                 info={"strategy": msg.get("strategy", ""), "source": "TrainingService"},
                                 timeout_s=float(msg.get("timeout_s", 600.0)))

    def op_save(self, msg: dict, tensors: dict) -> tuple[dict, None]:
        manager = self._manager(msg)
        state = self.backend.state_dict()
        if "extra" in msg:
            state["extra"] = msg["extra"]
        manager.save(self.backend.step, state, metrics=msg.get("metrics"))
        return {"step": self.backend.step, "path": str(manager.path(self.backend.step))}, None

    def op_load(self, msg: dict, tensors: dict) -> tuple[dict, None]:
        manager = self._manager(msg)
        state = manager.load(msg.get("step", "latest"), target=self.backend.prepared.checkpoint_target)
        self.backend.load_state_dict(state)
        return {"step": self.backend.step, "extra": state.get("extra")}, None

    def op_state_dict(self, msg: dict, tensors: dict) -> tuple[dict, dict | None]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.tensor import DTensor

        if not self.backend.prepared.local_state:  # one model over every rank: torch gathers it to rank 0's memory
            weights = get_model_state_dict(self.backend.model, options=StateDictOptions(full_state_dict=True,
                                                                                          cpu_offload=True))
            if self.rank != 0:
                return {"keys": []}, None
            return {"keys": list(weights)}, {k: v.detach().clone() for k, v in weights.items()}
        # a pipeline stage: its own parameters, gathered over the stage's ranks one tensor at a time (torch's
        # cpu_offload keeps only global rank 0's, and without it every rank would hold the whole stage on its device)
        at = self.layout.coords(self.rank)
        sends = at["dp_replicate"] == at["dp_shard"] == at["cp"] == at["tp"] == 0  # one rank per stage sends its part
        weights = {}
        for name, tensor in get_model_state_dict(self.backend.model).items():
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # (collective over the stage)
            if sends:
                weights[name] = full.detach().to("cpu", copy=True)
        return {"keys": list(weights)}, (weights if sends else None)

    def op_weights_open(self, msg: dict, tensors: dict) -> tuple[dict, None]:
        """Listen for weight-sync consumers (weights/); replies with this rank's address."""
        from disttrain.service.weights import Publisher

        if self.publisher is not None:
            self.publisher.close()
        self.publisher = Publisher(msg.get("host", "127.0.0.1"), msg["token"], bool(msg.get("delta", False)))
        return {"address": self.publisher.address}, None

    def op_weights_push(self, msg: dict, tensors: dict) -> tuple[dict, None]:
        """Send this rank's pieces of the weights to every consumer (weights/); a report, never a failure for a
        consumer's sake."""
        from disttrain.service.weights import local_pieces, parse_dtype

        if self.publisher is None:
            raise RuntimeError("weights_push before weights_open")
        pieces = local_pieces(self.backend.model, self.layout, self.rank)
        report = self.publisher.push(pieces, int(msg["version"]), parse_dtype(msg.get("dtype")),
                                     int(msg.get("bucket_bytes", 64 << 20)), bool(msg.get("delta", False)),
                                     int(msg.get("wait_for", 1)), float(msg.get("timeout_s", 60.0)))
        return {"report": {**report, "rank": self.rank}}, None

    def op_weights_close(self, msg: dict, tensors: dict) -> tuple[dict, None]:
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
        return {}, None

    def op_ping(self, msg: dict, tensors: dict) -> tuple[dict, None]:
        return {"step": self.backend.step, "pid": os.getpid()}, None

    def op_shutdown(self, msg: dict, tensors: dict) -> tuple[dict, None]:
        from disttrain.runtime import shutdown

        self.running = False
        if self.publisher is not None:
            self.publisher.close()
        if self.runtime is not None:
            self.backend = None
            shutdown(self.runtime, drain=bool(msg.get("drain", True)))
        return {}, None


def _inherited_optimizer(model) -> Callable:
    """The optimizer factory of a forked worker given the driver's live optimizer (or factory): the same class and
    parameter groups (hyperparameters, which parameters by name) over the model as the strategy wrapped or sharded
    it; the driver's optimizer state is not carried over."""
    import torch

    from disttrain.parallel.spec import optimizer_kwargs
    from disttrain.service.fork import inherited

    given = inherited("optimizer")
    if not isinstance(given, torch.optim.Optimizer):
        return given  # a factory(model)
    names = {id(p): n for n, p in model.named_parameters()}  # the driver's parameters, before the strategy
    unknown = [p for g in given.param_groups for p in g["params"] if id(p) not in names]
    if unknown:
        raise ValueError(f"optimizer: {len(unknown)} of its parameters are not the model's (build it over the model "
                         "given to the service, or pass a factory: optimizer=lambda model: AdamW(model.parameters()))")
    groups = [[names[id(p)] for p in g["params"]] for g in given.param_groups]

    def rebuild(wrapped) -> torch.optim.Optimizer:
        now = dict(wrapped.named_parameters())  # a pipeline stage holds some of them only
        mine = [{**{k: v for k, v in g.items() if k != "params"}, "params": [now[n] for n in names_ if n in now]}
                for g, names_ in zip(given.param_groups, groups, strict=True)]
        return type(given)([g for g in mine if g["params"]], **optimizer_kwargs(given))

    return rebuild


def serve(host: str, port: int, token: str, rank: int, world: int, heartbeat_s: float = 0.5) -> int:
    """Connect to the driver at host:port and serve commands until shutdown; returns an exit code."""
    sock = socket.create_connection((host, port), timeout=60)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return serve_on(sock, token, rank, world, heartbeat_s)


def serve_on(sock: socket.socket, token: str, rank: int, world: int, heartbeat_s: float = 0.5) -> int:
    """Serve the driver on a connected socket (TCP, or a forked worker's end of a socketpair) until shutdown."""
    conn = Connection(sock)
    conn.send({"op": "hello", "rank": rank, "world": world, "token": token, "pid": os.getpid(),
               "host": socket.gethostname()})
    try:
        return RankServer(conn, rank, world, heartbeat_s).serve()
    finally:
        conn.close()


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m disttrain.service.worker")
    parser.add_argument("--connect", required=True, help="the driver's HOST:PORT")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--heartbeat", type=float, default=0.5, help="seconds between heartbeats")
    parser.add_argument("--parent", type=int, default=0, help="die with this process (the driver's pid)")
    args = parser.parse_args(argv)
    if args.parent:
        die_with_parent(args.parent)
    logging.basicConfig(level=logging.INFO, format=f"[worker {args.rank}] %(levelname)s %(message)s")
    host, _, port = args.connect.rpartition(":")
    code = serve(host, int(port), os.environ.get(TOKEN_ENV, ""), args.rank, args.world, args.heartbeat)
    from disttrain.runtime import exit_process

    exit_process(code)  # skip gloo's racy static destructors (see runtime.exit_process)


if __name__ == "__main__":
    main()
