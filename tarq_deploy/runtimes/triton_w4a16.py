"""W4A16 on CUDA through our own Triton kernel: a Linear whose weight is the symmetric int4 lattice, dequantized in
registers, for decode (M = 1..16 rows, split-K) and anything larger (prefill, encoders).

The lattice (quant/lattice.py): code c in [-8, 7] per (output n, input k), one fp16 scale s per output and per group
of ``group_size`` inputs, value s * c. It is held exactly, for every fp16 scale (not only bf16-exact ones):

- packing (once, at load): u = c + 8 in [0, 15], eight inputs per int32 along K, input 8i + j in bits 4j..4j+3 of
  ``qweight[i, n]`` ([K/8, N] int32, N fastest: a row of the tile is one coalesced load); scales [K/g, N] fp16;
- the kernel unpacks a [BLOCK_K, BLOCK_N] tile of codes c (exact in fp16 and bf16), multiplies the activations by
  it on the tensor cores (``tl.dot``, fp32 accumulation: every product x * c is exact in fp32), and only then
  multiplies that group's partial sums by s in fp32. The weights are never rounded; the only roundings are fp32
  summation and the final cast of y (plus bias, added in fp32) to the activation dtype (fp16 or bf16).

Decode shapes (M <= 16): one program per (BLOCK_N outputs, K slice); the K range may be split (``split_k``) so that
there are about two programs per multiprocessor (Voxtral-Mini's 3072 x 3072 has only 48 column blocks of 64). Each
slice stores its fp32 partial sums in its own slot of a workspace, and a second small kernel sums the slots in a
fixed order, adds the bias and casts: deterministic (no atomics) and free of inter-program ordering (a first version
that let the last program of a column block finish the sum behind an atomic ticket returned wrong rows at M > 1 on
an H100). Every slot is written before it is read in each call, so one workspace serves all layers of a device and
is safe inside a CUDA graph (one stream at a time). ``split_k = 1`` is one launch. M > 16: tiles of 64 rows, no
split.

Needs CUDA and triton, or triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors for tests.
"""

from __future__ import annotations

import math
import os

import torch
from torch import nn

from ..quant.lattice import QuantizedWeight

try:  # optional: the module imports without triton; the layer then refuses with the reason
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    tl = None

__all__ = ["TritonInt4Linear", "block_k_for", "choose_split_k", "multiprocessor_count", "pack_codes",
           "replace_linears_triton", "triton_unavailable_reason", "unpack_codes"]

CODE_OFFSET = 8
PACK = 8  # codes per int32
MAX_BLOCK_K = 128
DECODE_M = 16  # rows a decode tile holds (tl.dot's smallest M)
PREFILL_BLOCK_M = 64
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16)
DEFAULT_BLOCK_N = 64
SUM_BLOCK_N = 512  # outputs per program of the split-K sum


def triton_unavailable_reason(device: str | torch.device | None = None) -> str | None:
    """None when the Triton W4A16 layer can run on ``device`` (default: CUDA), else why not, in words."""
    if triton is None:
        return "triton is not installed"
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    kind = torch.device(device).type if device is not None else "cuda"
    if kind == "cuda":
        if not torch.cuda.is_available():
            return f"no CUDA device available (torch {torch.__version__})"
        return None
    if interpret:
        return None
    return f"the Triton W4A16 kernel runs on CUDA (or under TRITON_INTERPRET=1), not on {kind}"


# ------------------------------------------------------------------------------------------------------ the kernel
if triton is not None:

    @triton.jit
    def _w4a16_kernel(x_ptr, qw_ptr, s_ptr, bias_ptr, y_ptr, ws_ptr,
                      M, N, K, stride_xm, stride_ym,
                      ITERS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr,
                      SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        rp = tl.arange(0, BLOCK_K // 8)
        shifts = (tl.arange(0, 8) * 4)[None, :, None]
        m_ok = rm < M
        n_ok = rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        first = pid_k * ITERS  # this program's K slice: ITERS tiles of BLOCK_K inputs
        for i in range(ITERS):
            k0 = (first + i) * BLOCK_K
            packed = tl.load(qw_ptr + (k0 // 8 + rp)[:, None] * N + rn[None, :], mask=n_ok[None, :], other=0)
            nibbles = (packed[:, None, :] >> shifts) & 0xF  # [BLOCK_K / 8, 8, BLOCK_N]: input 8i + j
            codes = (tl.reshape(nibbles, (BLOCK_K, BLOCK_N)) - 8).to(x_ptr.dtype.element_ty)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :], mask=m_ok[:, None], other=0.0)
            part = tl.dot(x, codes, out_dtype=tl.float32)  # sum_k x * c, exact products
            scale = tl.load(s_ptr + (k0 // GROUP) * N + rn, mask=n_ok, other=0.0).to(tl.float32)
            acc += part * scale[None, :]
        out_mask = m_ok[:, None] & n_ok[None, :]
        if SPLIT:  # this slice's partial sums, in its own slot: summed by _sum_splits_kernel in a fixed order
            slot = ws_ptr + pid_k * BLOCK_M * N
            tl.store(slot + (rm - pid_m * BLOCK_M)[:, None] * N + rn[None, :], acc, mask=out_mask)
        else:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_mask)

    @triton.jit
    def _sum_splits_kernel(ws_ptr, bias_ptr, y_ptr, N, stride_ym, SPLITS: tl.constexpr, ROWS: tl.constexpr,
                           BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr):
        row = tl.program_id(1)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        total = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for s in range(SPLITS):  # slices in order: the same bytes on every call (no atomics)
            total += tl.load(ws_ptr + (s * ROWS + row) * N + rn, mask=n_ok, other=0.0)
        if HAS_BIAS:
            total += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_ym + rn, total.to(y_ptr.dtype.element_ty), mask=n_ok)


# --------------------------------------------------------------------------------------------------------- packing
def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Lattice codes int8 [N, K] in [-8, 7] -> int32 [K/8, N]: input 8i + j of output n in bits 4j.. of [i, n]."""
    n, k = codes.shape
    if k % PACK:
        raise ValueError(f"K = {k} is not a multiple of {PACK}")
    if codes.min() < -CODE_OFFSET or codes.max() > CODE_OFFSET - 1:
        raise ValueError("int4 codes must lie in [-8, 7]")
    u = (codes.to(torch.int64) + CODE_OFFSET).t().reshape(k // PACK, PACK, n)  # [K/8, 8, N]
    shifts = (torch.arange(PACK, device=codes.device, dtype=torch.int64) * 4).view(1, PACK, 1)
    words = (u << shifts).sum(dim=1)  # 0 .. 2^32 - 1
    words = torch.where(words >= 2**31, words - 2**32, words)  # the same bits as int32
    return words.to(torch.int32).contiguous()


def unpack_codes(qweight: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_codes` (int8 [N, K]); for checks."""
    k8, n = qweight.shape
    shifts = (torch.arange(PACK, device=qweight.device, dtype=torch.int32) * 4).view(1, PACK, 1)
    u = (qweight.view(k8, 1, n) >> shifts) & 0xF
    return (u.reshape(k8 * PACK, n) - CODE_OFFSET).t().to(torch.int8).contiguous()


# ------------------------------------------------------------------------------------------------- launch choices
def block_k_for(group: int, k: int) -> int:
    """Inputs per tile: the group (32, 64, 128), or 128 for larger groups and per-channel scales."""
    if group <= MAX_BLOCK_K:
        if group not in (32, 64, 128):
            raise ValueError(f"group of {group} inputs: the Triton W4A16 kernel takes groups of 32, 64, 128 or a "
                             f"multiple of 128")
        return group
    if group % MAX_BLOCK_K or k % MAX_BLOCK_K:
        raise ValueError(f"group of {group} inputs (K = {k}): larger groups must be multiples of {MAX_BLOCK_K}")
    return MAX_BLOCK_K


def choose_split_k(n_blocks: int, iters: int, programs: int) -> int:
    """The smallest divisor d of ``iters`` with n_blocks * d >= programs (else ``iters``: one tile each)."""
    for d in range(1, iters + 1):
        if iters % d == 0 and n_blocks * d >= programs:
            return d
    return iters


_SM_COUNT: dict[int, int] = {}


def multiprocessor_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs are enough to exercise the split
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


class _Workspace:
    """Per device: one fp32 buffer of split_k x DECODE_M x N partial sums, shared by every layer (each call writes
    every slot it reads). Grown at layer construction only, never inside a forward (CUDA-graph safe)."""

    buffers: dict[str, torch.Tensor] = {}

    @classmethod
    def reserve(cls, device: torch.device, n: int, split_k: int) -> None:
        key = str(device)
        needed = split_k * DECODE_M * n
        if key not in cls.buffers or cls.buffers[key].numel() < needed:
            cls.buffers[key] = torch.empty(needed, device=device, dtype=torch.float32)

    @classmethod
    def get(cls, device: torch.device, n: int, split_k: int) -> torch.Tensor:
        cls.reserve(device, n, split_k)  # a no-op unless the layer was moved to another device after construction
        return cls.buffers[str(device)]


# ------------------------------------------------------------------------------------------------------ the module
class TritonInt4Linear(nn.Module):
    """y = x W^T (+ b) with W = s * c on the symmetric int4 lattice, W4A16 through :func:`_w4a16_kernel`.

    Activations fp16 or bf16 (y in the same dtype); any leading dims. ``block_n`` / ``split_k`` override the
    launch choice for decode shapes (M <= 16): split_k must divide K / BLOCK_K; None = about two programs per
    multiprocessor."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, in_features: int, out_features: int,
                 group_size: int, bias: torch.Tensor | None = None, block_n: int = DEFAULT_BLOCK_N,
                 split_k: int | None = None, num_warps: int = 4, num_stages: int = 2) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.block_k = block_k_for(group_size, in_features)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)
        self.num_warps, self.num_stages = num_warps, num_stages
        self.configure(block_n, split_k)

    def configure(self, block_n: int = DEFAULT_BLOCK_N, split_k: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None) -> "TritonInt4Linear":
        iters = self.in_features // self.block_k
        if block_n not in (16, 32, 64, 128, 256):
            raise ValueError(f"block_n {block_n}: one of 16, 32, 64, 128, 256")
        if split_k is not None and (split_k < 1 or iters % split_k):
            raise ValueError(f"split_k {split_k} must divide K / BLOCK_K = {iters}")
        self.block_n = block_n
        self.num_warps = num_warps or self.num_warps
        self.num_stages = num_stages or self.num_stages
        n_blocks = math.ceil(self.out_features / block_n)
        self.split_k = split_k or choose_split_k(n_blocks, iters, 2 * multiprocessor_count(self.qweight.device))
        _Workspace.reserve(self.qweight.device, self.out_features, self.split_k)
        return self

    @classmethod
    def from_lattice(cls, q: QuantizedWeight, bias: torch.Tensor | None = None,
                     device: str | torch.device = "cuda", **launch) -> "TritonInt4Linear":
        """Pack a lattice matrix (codes [N, K], fp16 scales [N, K/g]) once, on ``device``. ValueError when the
        kernel cannot hold it (bits, scheme, group, K)."""
        if q.spec.bits != 4 or q.spec.scheme != "symmetric":
            raise ValueError(f"the Triton W4A16 kernel holds the symmetric 4-bit lattice, not {q.spec}")
        n, k = q.codes.shape
        group = q.spec.group_width(k)
        block_k_for(group, k)
        device = torch.device(device)
        qweight = pack_codes(q.codes.to(device))
        scales = q.scales.to(device, torch.float16).t().contiguous()  # [K/g, N]
        bias = None if bias is None else bias.detach().to(device).clone()
        return cls(qweight, scales, k, n, group, bias, **launch)

    def launch_config(self, m: int) -> dict:
        if m <= DECODE_M:
            return {"BLOCK_M": DECODE_M, "BLOCK_N": self.block_n, "split_k": self.split_k}
        return {"BLOCK_M": PREFILL_BLOCK_M, "BLOCK_N": 64, "split_k": 1}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in ACTIVATION_DTYPES:
            raise TypeError(f"TritonInt4Linear takes float16 or bfloat16 activations, not {x.dtype}")
        if triton is None:
            raise RuntimeError(triton_unavailable_reason())
        flat = x.reshape(-1, self.in_features)
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        m, n, k = flat.shape[0], self.out_features, self.in_features
        y = torch.empty(m, n, device=flat.device, dtype=x.dtype)
        cfg = self.launch_config(m)
        split = cfg["split_k"]
        iters = k // self.block_k
        ws = _Workspace.get(self.qweight.device, n, split) if split > 1 else y
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), split, triton.cdiv(m, cfg["BLOCK_M"]))
        bias = self.bias if self.bias is not None else self.scales  # any pointer: unused without HAS_BIAS
        _w4a16_kernel[grid](flat, self.qweight, self.scales, bias, y, ws,
                            m, n, k, flat.stride(0), y.stride(0),
                            ITERS=iters // split, GROUP=self.group_size, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                            BLOCK_K=self.block_k, SPLIT=split > 1, HAS_BIAS=self.bias is not None,
                            num_warps=self.num_warps, num_stages=self.num_stages)
        if split > 1:
            _sum_splits_kernel[(triton.cdiv(n, SUM_BLOCK_N), m)](ws, bias, y, n, y.stride(0), SPLITS=split,
                                                                  ROWS=DECODE_M, BLOCK_N=SUM_BLOCK_N,
                                                                  HAS_BIAS=self.bias is not None, num_warps=4)
        return y.reshape(*x.shape[:-1], n)

    def dequantized_weight(self) -> torch.Tensor:
        """The lattice it holds, s * c as float32 [N, K] (exact: an fp16 scale times a code in [-8, 7]); for checks."""
        codes = unpack_codes(self.qweight).float()
        return codes * self.scales.float().t().repeat_interleave(self.group_size, dim=1)[:, : self.in_features]

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"block_n={self.block_n}, split_k={self.split_k}, bias={self.bias is not None}")


def replace_linears_triton(model: nn.Module, lattice: dict[str, QuantizedWeight],
                           device: str | torch.device | None = None, **launch) -> list[str]:
    """Swap every module named in ``lattice`` ("<module>.weight": an nn.Linear, or any layer with in/out_features
    of that shape, e.g. an Int4Linear) for a TritonInt4Linear of its lattice, keeping its bias; returns the names."""
    replaced = []
    for weight_name, q in lattice.items():
        module_name = weight_name.removesuffix(".weight")
        old = model.get_submodule(module_name)
        n, k = q.codes.shape
        if (getattr(old, "out_features", None), getattr(old, "in_features", None)) != (n, k):
            raise ValueError(f"{module_name}: not a Linear of shape {(n, k)}")
        bias = getattr(old, "bias", None)
        target = device if device is not None else next(t.device for t in (*old.parameters(), *old.buffers()))
        new = TritonInt4Linear.from_lattice(q, bias, target, **launch)
        parent_name, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        replaced.append(module_name)
    return replaced
