"""Reading a safetensors checkpoint: the dense part whole, routed experts one (layer, expert) at a time.

Routed experts use the standard per-expert names
`model.layers.{L}.mlp.experts.{E}.{gate,up,down}_proj.weight`. `read_experts` opens only the
files that hold the wanted tensors and reads only those tensors (safetensors maps the file), so
restoring a lost expert after a fault costs the size of that expert, not of the checkpoint.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from elastic_ep.errors import CheckpointError

from .config import MoEConfig

EXPERT_KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
INDEX_FILE = "model.safetensors.index.json"


def expert_key(layer: int, expert: int, proj: str) -> str:
    """The checkpoint name of one routed-expert projection (`proj`: gate_proj, up_proj or down_proj)."""
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"


class CheckpointReader:
    """Index of the tensors of a checkpoint directory and selective reads from it.

    Works with one `*.safetensors` file or several, with or without `model.safetensors.index.json`.
    Every tensor comes back as float32.
    """

    def __init__(self, model_dir: str | Path, config: MoEConfig | None = None):
        self.model_dir = Path(model_dir)
        self.config = config or MoEConfig.from_pretrained(self.model_dir)
        self.tensor_files: dict[str, Path] = self._index()
        self._handles: dict[Path, object] = {}

    def _index(self) -> dict[str, Path]:
        index_path = self.model_dir / INDEX_FILE
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index_path} is malformed ({e}); fix it or delete it") from e
            files = {name: self.model_dir / file for name, file in weight_map.items()}
            for path in set(files.values()):
                if not path.is_file():
                    raise CheckpointError(
                        f"{index_path} names {path.name}, which is missing from {self.model_dir}"
                    )
            return files
        paths = sorted(self.model_dir.glob("*.safetensors"))
        if not paths:
            raise CheckpointError(
                f"checkpoint dir {self.model_dir} has no *.safetensors files; "
                "weights must be in safetensors format (convert .bin files with transformers' save_pretrained)"
            )
        files: dict[str, Path] = {}
        for path in paths:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    files[name] = path
        return files

    def _handle(self, path: Path):
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path]

    def read_tensor(self, name: str) -> torch.Tensor:
        """One tensor by checkpoint name, as float32; CheckpointError if it is missing."""
        path = self.tensor_files.get(name)
        if path is None:
            raise missing_tensor(name, self.model_dir)
        return self._handle(path).get_tensor(name).to(torch.float32)

    def dense_state(self) -> dict[str, torch.Tensor]:
        """Every tensor except the routed experts: name -> float32 tensor."""
        return {name: self.read_tensor(name) for name in self.tensor_files if not EXPERT_KEY.match(name)}

    def read_experts(self, layer: int, expert_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights of the chosen routed experts of one layer, read alone.

        Returns w13: [n, 2I, H] (gate rows then up rows) and w2: [n, H, I], n = len(expert_ids).
        """
        hidden, inter = self.config.hidden_size, self.config.moe_intermediate_size
        w13 = torch.empty(len(expert_ids), 2 * inter, hidden)
        w2 = torch.empty(len(expert_ids), hidden, inter)
        for i, expert in enumerate(expert_ids):
            w13[i, :inter], w13[i, inter:], w2[i] = self.expert_projections(layer, expert)
        return w13, w2

    def expert_projections(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """gate [I, H], up [I, H] and down [H, I] of one routed expert, as float32 (views of the
        mapped file where the checkpoint is float32: copy them to keep them)."""
        cfg = self.config
        if layer not in cfg.moe_layers:
            raise CheckpointError(f"layer {layer} has no routed experts; MoE layers are {cfg.moe_layers}")
        if not 0 <= expert < cfg.num_experts:
            raise CheckpointError(f"expert {expert} is out of range; layer {layer} has {cfg.num_experts}")
        hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
        return (self._expert_tensor(layer, expert, "gate_proj", (inter, hidden)),
                self._expert_tensor(layer, expert, "up_proj", (inter, hidden)),
                self._expert_tensor(layer, expert, "down_proj", (hidden, inter)))

    def _expert_tensor(self, layer: int, expert: int, proj: str, shape: tuple[int, int]) -> torch.Tensor:
        name = expert_key(layer, expert, proj)
        tensor = self.read_tensor(name)
        check_shape(name, tensor, shape)
        return tensor

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one routed expert of one layer as held in memory (float32 gate, up and down)."""
        return 3 * self.config.hidden_size * self.config.moe_intermediate_size * 4


def check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Raise CheckpointError naming `name` when `tensor` does not have `shape`."""
    if tuple(tensor.shape) != tuple(shape):
        raise CheckpointError(
            f"tensor {name} has shape {list(tensor.shape)}, config.json implies {list(shape)}; "
            "the weights do not match config.json"
        )


def missing_tensor(name: str, model_dir: Path | None = None) -> CheckpointError:
    where = f"checkpoint {model_dir}" if model_dir else "the checkpoint"
    return CheckpointError(
        f"tensor {name} is missing from {where}; it is incomplete or was written for another configuration"
    )


def require_tensor(state: dict[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """state[name], checked to have `shape`; CheckpointError naming the tensor otherwise."""
    if name not in state:
        raise missing_tensor(name)
    check_shape(name, state[name], shape)
    return state[name]
