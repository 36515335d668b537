"""Reading a safetensors checkpoint: the dense part whole, routed experts one (layer, expert) at a time.

Routed experts use the standard per-expert names
`model.layers.{L}.mlp.experts.{E}.{gate,up,down}_proj.weight`. `read_experts` opens only the
files that hold the wanted tensors and reads only those tensors (safetensors maps the file), so
restoring a lost expert after a fault costs the size of that expert, not of the checkpoint.

Every read counts what it takes from storage (`bytes_read`, `files_opened`: what /cluster and
/metrics report per node) and waits its turn when `--load-read-rate-mb-s` throttles storage
(model/read_throttle.py). A reader opens a file when it first reads from it (or, without
`model.safetensors.index.json`, to list its tensors).

Tensors come out in the reader's `dtype` (float32 by default; "auto" is the checkpoint's own, as
transformers' `dtype="auto"` picks it) on the device a call names.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from elastic_ep.errors import CheckpointError

from .config import MoEConfig
from .read_throttle import ReadThrottle

EXPERT_KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
INDEX_FILE = "model.safetensors.index.json"
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
# transformers keeps DeepSeek-V3's router (weight and correction bias) in float32 whatever the
# model's dtype, and computes its logits in float32; so does this package.
FLOAT32_TENSORS = re.compile(r"\.mlp\.gate\.(weight|e_score_correction_bias)$")


def expert_key(layer: int, expert: int, proj: str) -> str:
    """The checkpoint name of one routed-expert projection (`proj`: gate_proj, up_proj or down_proj)."""
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"


def held_dtype(config: MoEConfig, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the model holds dense tensor `name` in when it computes in `dtype`."""
    if config.arch == "deepseek_v3" and FLOAT32_TENSORS.search(name):
        return torch.float32
    return dtype


class CheckpointReader:
    """Index of the tensors of a checkpoint directory and selective reads from it.

    Works with one `*.safetensors` file or several, with or without `model.safetensors.index.json`.
    dtype: torch.float32, torch.bfloat16, torch.float16, one of their names, or "auto": the dtype
    config.json declares (`dtype` / `torch_dtype`), else that of the stored embedding matrix.
    Every tensor comes back in `self.dtype` (DeepSeek-V3's router in float32, see `held_dtype`).
    """

    def __init__(
        self, model_dir: str | Path, config: MoEConfig | None = None, dtype: torch.dtype | str = torch.float32,
        throttle: ReadThrottle | None = None,
    ):
        self.model_dir = Path(model_dir)
        self.config = config or MoEConfig.from_pretrained(self.model_dir)
        self.throttle = throttle or ReadThrottle("", 0)
        self.bytes_read = 0  # of tensor data, as stored
        self.files_opened = 0
        self._handles: dict[Path, object] = {}
        self.tensor_files: dict[str, Path] = self._index()
        self.dtype: torch.dtype = self._resolve_dtype(dtype)

    def _resolve_dtype(self, dtype: torch.dtype | str) -> torch.dtype:
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        if dtype == "auto":
            declared = self.config.declared_dtype
            dtype = declared or self.stored_dtype("model.embed_tokens.weight")
            if dtype not in DTYPES:
                source = "config.json declares" if declared else "the checkpoint stores"
                raise CheckpointError(
                    f"{source} {dtype} weights in {self.model_dir}; --dtype auto supports "
                    f"{', '.join(DTYPES)}: pass one of them with --dtype"
                )
        if dtype not in DTYPES:
            raise CheckpointError(
                f"dtype {dtype!r} is not supported; choose auto or one of {', '.join(DTYPES)}"
            )
        return DTYPES[dtype]

    def stored_dtype(self, name: str) -> str:
        """The dtype tensor `name` is stored in ("bfloat16", ...), read from the file header alone."""
        path = self.tensor_files.get(name)
        if path is None:
            raise missing_tensor(name, self.model_dir)
        stored = self._handle(path).get_slice(name).get_dtype()
        return SAFETENSORS_DTYPES.get(stored, stored)

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
        return {name: path for path in paths for name in self._handle(path).keys()}

    def _handle(self, path: Path):
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
            self.files_opened += 1
        return self._handles[path]

    def read_tensor(self, name: str, device: torch.device | str = "cpu") -> torch.Tensor:
        """One tensor by checkpoint name, in the dtype it is held in (`held_dtype`), on `device`;
        CheckpointError if it is missing."""
        path = self.tensor_files.get(name)
        if path is None:
            raise missing_tensor(name, self.model_dir)
        tensor = self._handle(path).get_tensor(name)  # mapped: its pages are read by the copy below
        nbytes = tensor.numel() * tensor.element_size()
        self.throttle.charge(nbytes)
        self.bytes_read += nbytes
        return tensor.to(device=device, dtype=held_dtype(self.config, name, self.dtype))

    def dense_state(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Every tensor except the routed experts: name -> tensor in `self.dtype` on `device`."""
        return {
            name: self.read_tensor(name, device) for name in self.tensor_files if not EXPERT_KEY.match(name)
        }

    def read_experts(
        self, layer: int, expert_ids: list[int], device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights of the chosen routed experts of one layer, read alone.

        Returns w13: [n, 2I, H] (gate rows then up rows) and w2: [n, H, I], n = len(expert_ids),
        in `self.dtype` on `device`.
        """
        hidden, inter = self.config.hidden_size, self.config.moe_intermediate_size
        w13 = torch.empty(len(expert_ids), 2 * inter, hidden, dtype=self.dtype, device=device)
        w2 = torch.empty(len(expert_ids), hidden, inter, dtype=self.dtype, device=device)
        for i, expert in enumerate(expert_ids):
            w13[i, :inter], w13[i, inter:], w2[i] = self.expert_projections(layer, expert)
        return w13, w2

    def expert_projections(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """gate [I, H], up [I, H] and down [H, I] of one routed expert, in `self.dtype` on the CPU
        (views of the mapped file where it holds that dtype: copy them to keep them)."""
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

    def layout(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Every tensor's (stored dtype, shape), read from the file headers alone."""
        return {name: (self.stored_dtype(name), tuple(self._handle(path).get_slice(name).get_shape()))
                for name, path in self.tensor_files.items()}

    def difference(self, other: CheckpointReader) -> str:
        """Why `other` is not the same model as this checkpoint ("" when its config and every
        tensor's name, dtype and shape match; the values are not compared)."""
        if other.config != self.config:
            return f"{other.model_dir} has another config than {self.model_dir} (architecture, sizes or experts)"
        mine, theirs = self.layout(), other.layout()
        if mine.keys() != theirs.keys():
            names = sorted(mine.keys() ^ theirs.keys())
            return f"{other.model_dir} and {self.model_dir} differ in tensors {names[:3]}"
        wrong = sorted(name for name in mine if mine[name] != theirs[name])
        return (f"tensors {wrong[:3]} of {other.model_dir} differ from {self.model_dir} in dtype or shape: "
                f"{[theirs[n] for n in wrong[:3]]} against {[mine[n] for n in wrong[:3]]}") if wrong else ""

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one routed expert of one layer as held in memory (gate, up and down in `self.dtype`)."""
        return 3 * self.config.hidden_size * self.config.moe_intermediate_size * self.dtype.itemsize


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


class DenseWeights:
    """The tensors of a dense state as the model takes them: each checked against the shape
    config.json implies, then placed on `device` in the dtype it is held in (`held_dtype`).

    state: checkpoint name -> tensor of any dtype on any device (`CheckpointReader.dense_state()`,
    or a copy from a peer); `prefix` is put before every name asked for.
    """

    def __init__(
        self,
        config: MoEConfig,
        state: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        prefix: str = "",
    ):
        self.config, self.state, self.dtype, self.device, self.prefix = config, state, dtype, device, prefix

    def scope(self, prefix: str) -> DenseWeights:
        """The same weights with `prefix` added to every name."""
        return DenseWeights(self.config, self.state, self.dtype, self.device, self.prefix + prefix)

    def __contains__(self, name: str) -> bool:
        return self.prefix + name in self.state

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor `prefix + name`; CheckpointError if it is missing or not of `shape`."""
        name = self.prefix + name
        if name not in self.state:
            raise missing_tensor(name)
        check_shape(name, self.state[name], shape)
        return self.state[name].to(device=self.device, dtype=held_dtype(self.config, name, self.dtype))

    def optional(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """Like `get`, but None when the state has no such tensor (biases)."""
        return self.get(name, shape) if name in self else None
