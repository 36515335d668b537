"""Which device a rank computes on and which one its collectives use, from `--device`,
`--backend` and the rank's index among its node's ranks; checked by `serve` for its own ranks
before it starts them, so a setting that cannot work is refused at once with the reason."""

from __future__ import annotations

import torch

from elastic_ep.errors import ElasticEPError
from elastic_ep.model.model import resolve_device


def rank_devices(spec: str, backend: str, local_index: int) -> tuple[torch.device, torch.device]:
    """(compute device, collective device) of a rank: `spec` cpu, cuda or auto (cuda when present);
    on cuda each rank takes the GPU of its local index on its node. nccl needs a GPU per rank
    and runs its collectives there; gloo stages them through the host, so ranks may share a GPU.
    Raises ElasticEPError when nccl is asked for more ranks than this node has GPUs."""
    device = resolve_device(None if spec == "auto" else spec)
    if device.type == "cuda" and device.index is None:
        count = torch.cuda.device_count()
        if backend == "nccl" and local_index >= count:
            raise ElasticEPError(f"--backend nccl runs one rank per GPU, but this rank is number {local_index + 1} on "
                                 f"a node with {count} GPU(s): start fewer ranks here (--ranks / --local-ranks) or "
                                 "use --backend gloo")
        device = torch.device("cuda", local_index % count)
    if backend == "nccl" and device.type != "cuda":
        raise ElasticEPError("--backend nccl needs --device cuda (the GPUs of this node)")
    return device, device if backend == "nccl" else torch.device("cpu")


def check_node_devices(spec: str, backend: str, ranks: int) -> None:
    """Raise ElasticEPError, naming the flag to change, when `ranks` ranks of one node cannot all
    get a device under `spec` and `backend`."""
    for local_index in range(ranks):
        rank_devices(spec, backend, local_index)
