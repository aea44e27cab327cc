"""Interconnects and the time of a collective on them, as arithmetic (pure Python, no torch): an alpha-beta model
of each link, the presets the scale model is checked with, and the links `disttrain bench comm` measured
(`interconnect_from_fit`); the fit itself (`fit_alpha_beta`) and nccl-tests' bus factors.

Conventions (nccl-tests'): a collective's size S is the whole buffer (all_gather's output, reduce_scatter's input,
all_to_all's buffer per rank); algorithm bandwidth = S / time; bus bandwidth = algbw x `bus_factor`, the bytes each
rank puts on its link, so one link speed describes every collective at every world size. A link is (latency per
ring step, bus bandwidth per GPU per direction). Within a node collectives are rings; across nodes they are
hierarchical (all_reduce = reduce-scatter in the node, all-reduce of 1/g of the bytes across nodes on each GPU's
share of the network, all-gather in the node), which reduces to the flat ring when both links are equal.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from disttrain.errors import ConfigError

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")

DTYPES = ("float32", "bfloat16", "float16")
"""Element types `disttrain bench comm --dtype` measures and the scale model prices bytes of."""

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of each of `DTYPES`."""


def bus_factor(collective: str, n: int) -> float:
    """busbw / algbw for `n` ranks (nccl-tests' definitions)."""
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    return 1.0 if collective == "broadcast" else (n - 1) / n


def ring_steps(collective: str, n: int) -> int:
    """Sequential messages of a ring (pipelined chain for broadcast): what the latency term counts."""
    return 2 * (n - 1) if collective == "all_reduce" else n - 1


def fit_alpha_beta(sizes: list[float], times: list[float]) -> tuple[float, float]:
    """(alpha s, beta s/byte) of t = alpha + beta * size by least squares on the relative error, so that the
    microsecond points weigh as much as the second ones; both kept >= 0 (a negative one is set to 0 and the other
    refitted)."""
    a = [(1 / t, s / t) for s, t in zip(sizes, times, strict=True)]  # rows of the system a @ (alpha, beta) = 1
    s11, s12, s22 = sum(x * x for x, _ in a), sum(x * y for x, y in a), sum(y * y for _, y in a)
    r1, r2 = sum(x for x, _ in a), sum(y for _, y in a)
    det = s11 * s22 - s12 * s12
    alpha, beta = ((s22 * r1 - s12 * r2) / det, (s11 * r2 - s12 * r1) / det) if det > 0 else (-1.0, -1.0)
    if alpha >= 0 and beta >= 0:
        return alpha, beta
    if beta < 0 or s22 == 0:
        return r1 / s11, 0.0
    return 0.0, r2 / s22


# --- interconnects -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    latency_s: float
    """Per ring step (one message hop)."""
    bandwidth: float
    """Bus bandwidth per GPU per direction, bytes/s (what nccl-tests' busbw reaches)."""
    call_s: float = 0.0
    """Per collective call, however many ranks: on one CPU host a gloo call's fixed cost is handing the work to
    gloo's thread and waking the ranks' threads (about a scheduler tick when a core must be woken or freed), not
    the hops over loopback, which cost microseconds."""


@dataclass(frozen=True)
class Interconnect:
    name: str
    gpus_per_node: int
    intra: Mapping[str, Link]
    """Per collective, inside a node."""
    inter: Mapping[str, Link]
    """Per collective, across nodes: each GPU's share of its node's network."""
    note: str = ""
    cpu: Mapping[str, Link] | None = None
    """Per collective, on a CPU host where measured (`bench comm`'s `cpu_alpha_s`, `cpu_beta_s_per_byte`): the CPU
    time a call takes on the process group's threads, which is what a call issued while its rank computes costs a
    host whose cores all run ranks (its waiting overlaps the compute)."""
    dtypes: Mapping[str, Interconnect] | None = None
    """Links measured on other element types (`bench comm --dtype`: gloo reduces bfloat16 / float16 slower per byte
    than float32), each with the collectives measured in it; `for_dtype` picks them. Without one, these links (of
    float32, or of the fit's first dtype) price every element type's bytes."""

    def for_dtype(self, dtype: str, collective: str) -> Interconnect:
        """The links that price `collective` on elements of `dtype`: those measured in it, where they were (on this
        interconnect's devices per node)."""
        own = (self.dtypes or {}).get(dtype)
        if own is None or collective not in own.intra:
            return self
        return replace(own, gpus_per_node=self.gpus_per_node)


def uniform(link: Link) -> dict[str, Link]:
    return {c: link for c in COLLECTIVES}


PRESETS: dict[str, Interconnect] = {
    "h100-nvlink+ib-ndr": Interconnect(
        "h100-nvlink+ib-ndr", 8, uniform(Link(2e-6, 370e9)), uniform(Link(5e-6, 50e9)),
        "8 H100 per node, NVLink 4 ~370 GB/s bus bandwidth achieved per direction, one 400 Gb/s IB NDR NIC per GPU "
        "(50 GB/s); 2 us per NVLink step, 5 us per network step"),
    "v100-nvlink+100gbe": Interconnect(
        "v100-nvlink+100gbe", 8, uniform(Link(5e-6, 130e9)), uniform(Link(10e-6, 100e9 / 8 / 8)),
        "8 V100 per node (NVLink 2 ~130 GB/s bus bandwidth), one 100 Gb/s NIC per node shared by its 8 GPUs: the "
        "setting assumed for the PyTorch DDP paper's scaling figure"),
}


def interconnect_from_fit(fit: Mapping, name: str = "measured") -> Interconnect:
    """The links `disttrain bench comm` measured (its comm_fit.json): per collective, the bus bandwidth factor / beta
    and the fitted alpha, spread over the ring steps of the measured world size on accelerators, a cost per call on
    a CPU host (`Link.call_s`: at 3 ranks a gloo call pays it once, not once per hop). Devices per node = the measured
    world size; beyond it the same links are assumed (one measurement says nothing about a network). The fit's other
    element types (`dtypes`: `bench comm --dtype`) become `Interconnect.dtypes`."""
    world, per_call = int(fit["world_size"]), fit.get("device") == "cpu"
    if world < 2:
        raise ConfigError(f"{name}: world_size {world}: a fit of links needs 2 or more ranks; rerun `disttrain bench "
                          "comm` with --nproc 2 or more")
    links, cpu = _links(fit["collectives"], world, per_call, name)
    busy = {"step": f", each rank computing {fit.get('compute_ms', 0):g} ms before each call (--busy step)",
            True: ", each rank's core computing meanwhile (--busy 1)"}.get(fit.get("busy"), "")
    others = {}
    for dtype, fits in (fit.get("dtypes") or {}).items():
        if dtype not in DTYPES:
            raise ConfigError(f"{name}: dtype {dtype!r} is not one of {', '.join(DTYPES)}; rerun `disttrain bench "
                              "comm`")
        own, own_cpu = _links(fits, world, per_call, f"{name} ({dtype})")
        others[dtype] = Interconnect(f"{name} ({dtype})", world, own, own, cpu=own_cpu or None)
    first = fit.get("dtype", "float32")
    dtypes = (f"; {first}, and {', '.join(others)} where sent" if others else
              f"; measured in {first}, which prices every element type's bytes" if first != "float32" else "")
    return Interconnect(name, world, links, links, f"{fit['backend']} on {fit.get('host', '?')}, {world} ranks{busy}, "
                        f"measured {fit.get('date', '?')}" + ("; CPU time per call too" if cpu else "") + dtypes,
                        cpu=cpu or None, dtypes=others or None)


def _links(fits: Mapping, world: int, per_call: bool, name: str) -> tuple[dict[str, Link], dict[str, Link]]:
    """(links, CPU links) of one element type's fitted collectives, which must include all_reduce, all_gather and
    reduce_scatter (a hierarchical all-reduce runs all three); the CPU links only where all three have a CPU fit
    (what DDP's buckets use)."""
    links, cpu = {}, {}
    for c, f in fits.items():
        for prefix in ("", "cpu_") if per_call and "cpu_alpha_s" in f else ("",):
            numbers = [f.get(f"{prefix}alpha_s"), f.get(f"{prefix}beta_s_per_byte")]
            if not all(isinstance(x, int | float) and math.isfinite(x) and x >= 0 for x in numbers):
                raise ConfigError(f"{name}: {c}'s {prefix}alpha_s and {prefix}beta_s_per_byte must be finite numbers "
                                  f">= 0, not {numbers}; rerun `disttrain bench comm`")
        bandwidth = bus_factor(c, world) / f["beta_s_per_byte"] if f["beta_s_per_byte"] > 0 else math.inf
        links[c] = (Link(0.0, bandwidth, call_s=f["alpha_s"]) if per_call
                    else Link(f["alpha_s"] / max(ring_steps(c, world), 1), bandwidth))
        if per_call and "cpu_alpha_s" in f:
            beta = f["cpu_beta_s_per_byte"]
            cpu[c] = Link(0.0, bus_factor(c, world) / beta if beta > 0 else math.inf, call_s=f["cpu_alpha_s"])
    missing = [c for c in ("all_reduce", "all_gather", "reduce_scatter") if c not in links]
    if missing:
        raise ConfigError(f"{name}: the fit has no {', '.join(missing)}; rerun `disttrain bench comm` with them")
    return links, (cpu if all(c in cpu for c in ("all_reduce", "all_gather", "reduce_scatter")) else {})


def ring_time(collective: str, nbytes: float, n: int, link: Link) -> float:
    """Seconds of `collective` of `nbytes` around a ring of `n` ranks on `link` (a chain for broadcast): its hops'
    latency and its bus bytes over the bandwidth, without a link's cost per call."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    volume = nbytes if collective == "broadcast" else bus_factor(collective, n) * nbytes
    return ring_steps(collective, n) * link.latency_s + volume / link.bandwidth


def collective_time(collective: str, nbytes: float, n: int, net: Interconnect) -> float:
    """Seconds for `collective` of `nbytes` (nccl-tests' size) over `n` ranks, hierarchical across nodes; a link's
    cost per call (`Link.call_s`) once, however many phases the hierarchy runs."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return net.intra[collective].call_s + _phases(collective, nbytes, n, net)


def _phases(collective: str, nbytes: float, n: int, net: Interconnect) -> float:
    g = min(n, net.gpus_per_node)
    nodes = math.ceil(n / g)
    intra, inter = net.intra[collective], net.inter[collective]
    if nodes == 1:
        return ring_time(collective, nbytes, n, intra)
    if collective == "all_reduce":
        return (ring_time("reduce_scatter", nbytes, g, net.intra["reduce_scatter"])
                + ring_time("all_reduce", nbytes / g, nodes, inter)
                + ring_time("all_gather", nbytes, g, net.intra["all_gather"]))
    if collective in ("all_gather", "reduce_scatter"):
        return ring_time(collective, nbytes, g, intra) + ring_time(collective, nbytes / g, nodes, inter)
    if collective == "all_to_all":
        return ((g - 1) * intra.latency_s + (nodes - 1) * inter.latency_s
                + nbytes * (g - 1) / n / intra.bandwidth + nbytes * (n - g) / n / inter.bandwidth)
    return ((g - 1) * intra.latency_s + (nodes - 1) * inter.latency_s  # broadcast: a chain, g NICs per node
            + nbytes / min(intra.bandwidth, g * inter.bandwidth))


def with_gpus_per_node(net: Interconnect, gpus: int) -> Interconnect:
    return replace(net, gpus_per_node=gpus)
