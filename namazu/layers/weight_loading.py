"""How one parameter receives its checkpoint tensor, whole or only the slice its rank holds.

Every parameter of the model may carry a `weight_loader(param, loaded)` attribute (as nano-vllm and vLLM
do); the model loader calls it with the checkpoint tensor, which is either a `torch.Tensor` or a
`LazyTensor`: a handle on a tensor in a safetensors file whose shape and dtype are known but whose data is
read only when asked, row or column range at a time. A column-parallel weight asks for its output rows,
a row-parallel one for its input columns, so a rank of a tensor-parallel model reads only its part of
the checkpoint. Parameters without a loader of their own take `default_weight_loader` (whole tensor,
exact shape).

Loaders raise ValueError/TypeError with a message that does not repeat the tensor's name; the model
loader prefixes it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from namazu.config import ModelConfig

# safetensors dtype names -> torch (every dtype a safetensors file can hold that torch knows)
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}


@dataclass(frozen=True)
class TPShard:
    """Which part of a tensor-parallel model this copy of the model holds: rank `rank` of `size`."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of {self.size}: need 0 <= rank < size")

    def split(self, n: int, what: str) -> int:
        """This rank's share of a dimension of size `n` (which must divide evenly)."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {self.size}")
        return n // self.size


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """Raises ValueError naming each dimension of `cfg` that `size` ranks cannot split as `TPShard.split`
    does (whole heads, equal slices; the vocabulary need not divide: it is padded). The engine calls it
    before any rank starts, so the error is one message naming the field instead of every rank's loader
    failing on its own."""
    if size == 1:
        return
    dims = {"num_attention_heads": cfg.num_attention_heads}
    if any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        dims["intermediate_size"] = cfg.intermediate_size
    if any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        dims["moe_intermediate_size"] = cfg.moe_intermediate_size
    bad = [f"{name} ({n})" for name, n in dims.items() if n % size]
    if bad:
        raise ValueError(f"--tensor-parallel-size {size}: {', '.join(bad)} not divisible by {size}; each rank "
                         "holds whole heads and an equal slice of each intermediate dimension")


class LazyTensor:
    """A tensor of an open safetensors file, read on demand (whole, or a range along one dimension)."""

    def __init__(self, handle, name: str):
        self._handle, self.name = handle, name
        sl = handle.get_slice(name)
        self.shape = torch.Size(sl.get_shape())
        st_dtype = sl.get_dtype()
        if st_dtype not in _ST_DTYPES:
            raise TypeError(f"{name}: unsupported dtype {st_dtype} (no torch equivalent)")
        self.dtype = _ST_DTYPES[st_dtype]

    def read(self) -> torch.Tensor:
        return self._read(None)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._read(index)

    def _read(self, index: tuple[slice, ...] | None) -> torch.Tensor:
        # The one place checkpoint bytes are read (tests spy on it to see what a rank reads).
        if index is None:
            return self._handle.get_tensor(self.name)
        return self._handle.get_slice(self.name)[index]

    def __repr__(self) -> str:
        return f"LazyTensor({self.name}, shape={tuple(self.shape)}, dtype={self.dtype})"


Loaded = torch.Tensor | LazyTensor


def materialize(loaded: Loaded) -> torch.Tensor:
    return loaded.read() if isinstance(loaded, LazyTensor) else loaded


@torch.no_grad()
def load_shard(dst: torch.Tensor, loaded: Loaded, full_shape: tuple[int, ...], shard_dim: int | None = None,
               rank: int = 0, exact_dtype: bool = False) -> None:
    """Checks `loaded` has the model's full (unsharded) shape, then copies this rank's part into `dst`:
    along `shard_dim` the `dst.shape[shard_dim]` elements starting at rank * that size (None: all of it).
    Floating-point tensors convert to dst's dtype; `exact_dtype` (packed codes, fp8 scales) refuses any
    other dtype."""
    if tuple(loaded.shape) != tuple(full_shape):
        raise ValueError(f"shape {tuple(loaded.shape)} does not match the model's {tuple(full_shape)}")
    if exact_dtype and loaded.dtype != dst.dtype:
        raise TypeError(f"dtype {loaded.dtype}, expected {dst.dtype}")
    if not exact_dtype and not loaded.dtype.is_floating_point:
        raise TypeError(f"dtype {loaded.dtype} where a floating-point weight is expected")
    if shard_dim is None:
        src = materialize(loaded)
    else:
        n = dst.shape[shard_dim]
        src = loaded.narrow(shard_dim, rank * n, n)   # a LazyTensor reads only these elements
    dst.copy_(src.to(dst.dtype))


def default_weight_loader(param: torch.Tensor, loaded: Loaded) -> None:
    """A replicated tensor: the checkpoint tensor must have exactly the parameter's shape."""
    load_shard(param.data, loaded, tuple(param.shape))
