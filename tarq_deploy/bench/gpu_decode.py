"""GPU benchmark: per-token decode of Voxtral-Mini-3B's language model with CUDA graphs, FP16 vs INT4 kernels.

    python -m tarq_deploy.bench.gpu_decode [--layers 30] [--context 383] [--new-tokens 64] [--repeats 5]
                                [--kernels tinygemm,triton] [--out bench/results/gpu_decode.json]

Why: eager transformers decodes Voxtral-Mini at ~30 ms/token in FP16 and INT4 alike (bench/results/h100): the GPU
waits for Python to launch ~20 kernels per layer. Here one decode step is captured in a ``torch.cuda.CUDAGraph``
(manual capture; no torch.compile) and replayed, so a token costs what its kernels cost: mostly reading the weights.

Model: the Llama language model of Voxtral-Mini-3B-2507 at its real dimensions (``gpu_voxtral.TEXT_CONFIG``: hidden
3072, 30 layers, 32 / 8 heads, head_dim 128, MLP 8192, vocab 131072), random seeded fp16 weights; every decoder
Linear snapped onto the int4 g128 lattice with bf16-exact scales (``gpu_voxtral.snap_layers``), so FP16 (cuBLAS,
the dequantized lattice) and every INT4 kernel compute the same weights. Embedding and lm_head stay fp16 in all
variants (as the project's Voxtral lattice leaves them). ``--layers`` cuts layers.

Decode loop (:class:`StaticDecoder`, our own minimal Llama forward over the model's modules, checked on the CPU
against transformers' forward): a static KV cache [layers, kv_heads, max_len, head_dim], RoPE tables indexed by a
position tensor, GQA without copying the cache (the 4 query heads of a kv head are folded into the query length),
SDPA with a mask over the whole static cache, greedy argmax written back into the input token on the device and
the position advanced on the device: replaying the graph N times decodes N tokens with no CPU in the loop.

Per variant (FP16 = cuBLAS; INT4 tinygemm = ``runtimes.int4_linear.Int4Linear``, bf16 activations; INT4 triton =
``runtimes.triton_w4a16.TritonInt4Linear``): prefill of ``--context`` tokens (eager, CUDA events), eager decode
ms/token, graph decode ms/token (median of ``--repeats`` runs of ``--new-tokens`` replays after a warm-up run), peak
VRAM (``max_memory_allocated`` from the variant's start), bytes of weights read per token (every parameter and
buffer but the embedding table, plus one embedding row) and of KV cache read per token (the whole static cache);
against the measured HBM bandwidth (a 1 GiB device-to-device copy, bytes read + written / time) that gives a floor
in ms/token. Agreement with FP16: the INT4 model teacher-forced on FP16's greedy tokens for ``--agreement-steps``
steps after its own prefill: relative Frobenius error of the logits and top-1 agreement.

Kernels: every decoder Linear shape at M = 1, 4, 16: the modules of that shape in all layers called in turn
inside one CUDA graph (so weights stream from HBM, not L2, when they exceed it), time per call; cuBLAS fp16,
tinygemm and triton. With ``--tune`` the Triton layer's (block_n, split_k) is picked per shape from a few
candidates at M = 1 before the decode is measured.

Goal (issue 29): INT4 >= 1.4x FP16 per decoded token with some kernel, or the measured reason none reaches it.
Without CUDA: prints "CUDA not available: nothing measured" and exits 0. JSON (``--out``) is rewritten after every
stage, so a run cut short still leaves what it measured; a markdown table beside it (``.md``).
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from tarq_deploy.fileio import write_json_atomic, write_text_atomic

__all__ = ["StaticDecoder", "build_text_model", "weight_bytes"]

DEVICE = "cuda"  # the only device measured; a module constant so that the Python around it can be exercised on a CPU
SPEEDUP_GOAL = 1.4
KERNEL_M = (1, 4, 16)
KERNEL_REPLAYS = 20
VARIANTS = ("fp16", "tinygemm", "triton")
SHAPE_GROUPS = {  # decoder Linears sharing a shape, timed together (more bytes than L2 holds)
    "q_proj": ("self_attn.q_proj",),  # 4096 x 3072 (32 heads of 128)
    "o_proj": ("self_attn.o_proj",),  # 3072 x 4096
    "k_proj/v_proj": ("self_attn.k_proj", "self_attn.v_proj"),
    "gate_proj/up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}
# (block_n, programs per multiprocessor to reach by splitting K; 0: no split, one launch per Linear)
TRITON_CANDIDATES = ((16, 0), (32, 0), (64, 0), (64, 2), (128, 2), (32, 2), (64, 4))
TRITON_PIPELINES = ((4, 2), (8, 3), (4, 4))  # (num_warps, num_stages) tried with the best block/split


# ------------------------------------------------------------------------------------------------------ the model
def text_config(layers: int):
    from transformers import LlamaConfig

    from .gpu_voxtral import TEXT_CONFIG

    fields = {k: v for k, v in TEXT_CONFIG.items() if k != "model_type"}
    return LlamaConfig(**{**fields, "num_hidden_layers": layers})


def build_text_model(config, seed: int, device: str = DEVICE, dtype: torch.dtype = torch.float16):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    return model.eval()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm (transformers' LlamaRMSNorm: float32 statistics, weight times the result in h's dtype)."""
    hf = h.float()
    return weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    h = h + delta
    return h, rms_norm(h, weight, eps)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@dataclass(frozen=True)
class Glue:
    """The decoder's element-wise work between the Linears (norms, residual adds, rotary embedding, SiLU x up): eager
    (a handful of kernels each) or compiled by torch.compile into one fused kernel each. The Linears stay outside the
    compiled functions, so FP16 and every INT4 kernel get the same glue."""

    norm: Callable
    add_norm: Callable
    rope: Callable
    silu_mul: Callable

    @classmethod
    def eager(cls) -> "Glue":
        return cls(rms_norm, add_rms_norm, rope, silu_mul)

    @classmethod
    def compiled(cls) -> "Glue":
        compile_ = functools.partial(torch.compile, dynamic=False, fullgraph=True)
        return cls(compile_(rms_norm), compile_(add_rms_norm), compile_(rope), compile_(silu_mul))


def fused_linears(model, lattice: dict | None, kernel: str) -> list[dict]:
    """Per layer: q/k/v as one matrix and gate/up as one (rows stacked), for FP16 from the weights and for an INT4
    kernel from the lattice's rows stacked (the same exact values: codes and group scales are per row)."""
    fused = []
    for i, layer in enumerate(model.model.layers):
        names = {"qkv": [f"self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj")],
                 "gate_up": ["mlp.gate_proj", "mlp.up_proj"]}
        fused.append({key: _stacked(model, layer, f"model.layers.{i}", parts, lattice, kernel)
                      for key, parts in names.items()})
    return fused


def _stacked(model, layer, prefix: str, parts: list[str], lattice: dict | None, kernel: str):
    if kernel == "fp16":
        weight = torch.cat([layer.get_submodule(p).weight for p in parts]).contiguous()
        return functools.partial(F.linear, weight=weight)
    from tarq_deploy.quant.lattice import QuantizedWeight

    pieces = [lattice[f"{prefix}.{p}.weight"] for p in parts]
    q = QuantizedWeight(torch.cat([p.codes for p in pieces]), torch.cat([p.scales for p in pieces]), pieces[0].spec)
    if kernel == "tinygemm":
        from tarq_deploy.runtimes.int4_linear import Int4Linear

        return Int4Linear.from_lattice(q, device=DEVICE)
    from tarq_deploy.runtimes.triton_w4a16 import TritonInt4Linear

    return TritonInt4Linear.from_lattice(q, device=DEVICE)


class StaticDecoder:
    """A Llama forward over a static KV cache, graph-capturable: no host sync, no allocation that depends on data.

    ``forward(ids [1, T], positions [T])`` writes K/V at ``positions`` and returns the last position's logits
    [1, vocab]; ``step()`` decodes one token from ``self.token`` at ``self.position`` (both device tensors) and
    advances them; ``capture()`` records one step in a CUDA graph."""

    def __init__(self, model, max_len: int, fused: list[dict] | None = None, glue: "Glue | None" = None) -> None:
        cfg = model.config
        self.model = model
        self.fused = fused  # per layer {"qkv": module, "gate_up": module}: one kernel where there were three / two
        self.glue = glue or Glue.eager()
        self.layers = list(model.model.layers)
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.groups = self.heads // self.kv_heads
        self.max_len = max_len
        p = model.model.embed_tokens.weight
        self.device, self.dtype = p.device, p.dtype
        shape = (len(self.layers), 1, self.kv_heads, max_len, self.head_dim)
        self.k_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.v_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        positions = torch.arange(max_len, device=self.device)
        with torch.no_grad():
            cos, sin = model.model.rotary_emb(self.k_cache[0, 0], positions[None])  # [1, max_len, head_dim]
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()
        self.key_index = positions
        self.eps = cfg.rms_norm_eps
        self.qkv_widths = [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim]
        self.token = torch.zeros(1, 1, device=self.device, dtype=torch.long)
        self.position = torch.zeros(1, device=self.device, dtype=torch.long)
        self.logits: torch.Tensor | None = None
        self.graph = None

    def cache_bytes_read(self) -> int:
        """K and V of every layer over the whole static cache: what the masked attention reads per step."""
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        h = self.model.model.embed_tokens(ids)  # [1, T, hidden]
        cos, sin = self.cos[positions][None, None], self.sin[positions][None, None]  # [1, 1, T, d]
        allowed = self.key_index[None, :] <= positions[:, None]  # [T, max_len] causal over the static cache
        mask = allowed.repeat(self.groups, 1)[None, None]  # [1, 1, groups * T, max_len]
        glue = self.glue
        x = glue.norm(h, self.layers[0].input_layernorm.weight, self.eps)
        for i, layer in enumerate(self.layers):
            h, x = glue.add_norm(h, self._attention(i, layer, x, positions, cos, sin, mask, t),
                                 layer.post_attention_layernorm.weight, self.eps)
            following = self.layers[i + 1].input_layernorm.weight if i + 1 < len(self.layers) else None
            h, x = glue.add_norm(h, self._mlp(i, layer.mlp, x), following if following is not None
                                 else self.model.model.norm.weight, self.eps)
        return self.model.lm_head(x[:, -1:])[:, -1]

    def _qkv(self, i, attn, x, t):
        if self.fused:
            q, k, v = self.fused[i]["qkv"](x).split(self.qkv_widths, dim=-1)
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        return (q.view(1, t, self.heads, self.head_dim).transpose(1, 2),
                k.view(1, t, self.kv_heads, self.head_dim).transpose(1, 2),
                v.view(1, t, self.kv_heads, self.head_dim).transpose(1, 2))

    def _attention(self, i, layer, x, positions, cos, sin, mask, t):
        attn = layer.self_attn
        q, k, v = self._qkv(i, attn, x, t)
        q, k = self.glue.rope(q, k, cos, sin)
        self.k_cache[i].index_copy_(2, positions, k)
        self.v_cache[i].index_copy_(2, positions, v)
        # GQA: the query heads of one kv head side by side along the query axis -> [1, kv, groups * T, d]
        q = q.reshape(1, self.kv_heads, self.groups * t, self.head_dim)
        o = F.scaled_dot_product_attention(q, self.k_cache[i], self.v_cache[i], attn_mask=mask)
        o = o.reshape(1, self.heads, t, self.head_dim).transpose(1, 2).reshape(1, t, self.heads * self.head_dim)
        return attn.o_proj(o)

    def _mlp(self, i, mlp, x):
        if self.fused:
            gate, up = self.fused[i]["gate_up"](x).chunk(2, dim=-1)
        else:
            gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        return mlp.down_proj(self.glue.silu_mul(gate, up))

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Fill the cache with ``ids`` [1, T] at positions 0..T-1; set the next token (argmax) and position."""
        positions = torch.arange(ids.shape[1], device=self.device)
        logits = self.forward(ids, positions)
        self.token.copy_(logits.argmax(-1).view(1, 1))
        self.position.fill_(ids.shape[1])
        return logits

    def step(self) -> torch.Tensor:
        logits = self.forward(self.token, self.position)
        self.token.copy_(logits.argmax(-1).view(1, 1))
        self.position.add_(1)
        return logits

    def forced_step(self, token: int) -> torch.Tensor:
        """One step on a given token (teacher forcing): logits, cache and position advance as in step()."""
        self.token.fill_(token)
        return self.step()

    def capture(self, warmup_steps: int = 3) -> None:
        """Record one step (warm-up steps on a side stream first, as torch.cuda.graphs asks); resets nothing."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup_steps):
                self.step()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.step()

    def set_state(self, token: int, position: int) -> None:
        self.token.fill_(token)
        self.position.fill_(position)


# ------------------------------------------------------------------------------------------------------ timing
def cuda_ms(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def hbm_bandwidth(gib: float = 1.0, iters: int = 10) -> dict:
    """Device-to-device copy of ``gib`` GiB: (bytes read + bytes written) / time, median of ``iters``."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device=DEVICE).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = [cuda_ms(lambda: dst.copy_(src)) for _ in range(iters)]
    ms = statistics.median(times)
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes_per_copy": 2 * n, "median_ms": ms, "bytes_per_s": 2 * n / (ms / 1e3)}


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter and buffer but the embedding table, plus one row."""
    embed = model.model.embed_tokens.weight
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return total - embed.numel() * embed.element_size() + embed.shape[1] * embed.element_size()


def decode_figures(dec: StaticDecoder, context: torch.Tensor, new_tokens: int, repeats: int) -> dict:
    """Prefill, eager decode and graph decode timings of one variant (the cache is refilled by the prefill)."""
    dec.prefill(context)  # warm-up (Triton compiles its prefill tiles here)
    prefill_ms = cuda_ms(lambda: dec.prefill(context))
    first, start = int(dec.token.item()), context.shape[1]

    def eager():
        for _ in range(new_tokens):
            dec.step()

    eager()  # warm-up (and Triton's compiles)
    dec.set_state(first, start)
    eager_ms = cuda_ms(eager) / new_tokens
    dec.set_state(first, start)
    t0 = time.perf_counter()
    dec.capture()
    capture_s = time.perf_counter() - t0

    def replay():
        for _ in range(new_tokens):
            dec.graph.replay()

    runs = []
    for r in range(repeats + 1):
        dec.set_state(first, start)
        ms = cuda_ms(replay) / new_tokens
        if r:  # the first run warms up
            runs.append(ms)
    return {"prefill_ms": prefill_ms, "eager_ms_per_token": eager_ms, "graph_ms_per_token": statistics.median(runs),
            "graph_runs_ms_per_token": runs, "capture_s": capture_s, "new_tokens": new_tokens}


def reference_run(dec: StaticDecoder, context: torch.Tensor, steps: int) -> tuple[list[int], torch.Tensor]:
    """FP16's greedy tokens and logits [steps + 1, vocab] (the prefill's last logits first), eager."""
    logits = [dec.prefill(context).float()]
    tokens = [int(dec.token.item())]
    for _ in range(steps):
        logits.append(dec.step().float())
        tokens.append(int(dec.token.item()))
    return tokens, torch.cat(logits)


def forced_logits(dec: StaticDecoder, context: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    logits = [dec.prefill(context).float()]
    for token in tokens[:-1]:
        logits.append(dec.forced_step(token).float())
    return torch.cat(logits)


def agreement(test: torch.Tensor, ref: torch.Tensor) -> dict:
    return {"relative_error": float((test - ref).norm() / ref.norm()),
            "max_abs_diff": float((test - ref).abs().max()),
            "top1_agreement": float((test.argmax(-1) == ref.argmax(-1)).float().mean()),
            "steps": int(ref.shape[0])}


# ------------------------------------------------------------------------------------------------------ kernels
def kernel_times(model, kernel: str, ms: tuple[int, ...] = KERNEL_M) -> list[dict]:
    """Per decoder Linear shape and M: mean time per call over all layers' modules of that shape, in one graph."""
    rows = []
    for label, names in SHAPE_GROUPS.items():
        modules = [layer.get_submodule(n) for layer in model.model.layers for n in names]
        rows += [_time_modules(modules, label, kernel, m) for m in ms]
    return rows


def _time_modules(modules: list, label: str, kernel: str, m: int) -> dict:
    first = modules[0]
    k, n = first.in_features, first.out_features
    x = torch.randn(m, k, device=DEVICE, dtype=torch.float16)
    nbytes = sum(t.numel() * t.element_size() for mod in modules for t in [*mod.parameters(), *mod.buffers()])
    row = {"shape": label, "n_out": n, "k_in": k, "m": m, "kernel": kernel, "calls_per_replay": len(modules),
           "bytes_per_replay": nbytes}
    try:
        with torch.no_grad():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for mod in modules:
                    mod(x)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for mod in modules:
                    mod(x)
        graph.replay()
        ms = statistics.median(cuda_ms(graph.replay) for _ in range(KERNEL_REPLAYS))
        del graph
    except Exception as e:  # one shape failing must not end the bench
        return {**row, "error": f"{type(e).__name__}: {e}"}
    per_call = ms / len(modules)
    return {**row, "ms_per_call": per_call, "bytes_per_s": nbytes / (ms / 1e3)}


def launch_error(module, rows: tuple[int, ...] = (1, 4, 16)) -> str | None:
    """None when the layer's product matches its lattice's (float32 reference) at M = ``rows``, else what is off."""
    weight = module.dequantized_weight()
    for m in rows:
        x = torch.randn(m, module.in_features, device=weight.device, dtype=torch.float16)
        want = x.float() @ weight.t()
        got = module(x).float()
        error = ((got - want).norm() / want.norm()).item()
        if not error < 2e-3:  # fp16 output rounding gives ~3e-4
            return f"M = {m}: relative error {error:.3g} against the lattice"
    return None


def tune_triton(model, fused: list[dict] | None = None) -> list[dict]:
    """Pick (block_n, split_k) per shape at M = 1 among TRITON_CANDIDATES; configures the model's layers (and the
    fused q/k/v and gate/up matrices, when given)."""
    groups = {label: [layer.get_submodule(n) for layer in model.model.layers for n in names]
              for label, names in SHAPE_GROUPS.items()}
    for key in (fused[0] if fused else {}):
        groups[f"fused {key}"] = [f[key] for f in fused]
    tried = []
    for label, modules in groups.items():
        tried += _tune_group(label, modules)
    return tried


def _tune_group(label: str, modules: list) -> list[dict]:
    from tarq_deploy.runtimes.triton_w4a16 import multiprocessor_count, choose_split_k

    sms = multiprocessor_count(modules[0].qweight.device)
    iters = modules[0].in_features // modules[0].block_k
    tried, best = [], None
    for block_n, per_sm in TRITON_CANDIDATES:
        split = choose_split_k(math.ceil(modules[0].out_features / block_n), iters, per_sm * sms) if per_sm else 1
        for mod in modules:
            mod.configure(block_n, split)
        wrong = launch_error(modules[0])
        if wrong:  # a launch choice that does not compute the lattice's product is never timed, let alone picked
            tried.append({"shape": label, "block_n": block_n, "split_k": split, "error": wrong})
            continue
        row = {**_time_modules(modules, label, "triton", 1), "block_n": block_n, "split_k": split}
        tried.append(row)
        if "ms_per_call" in row and (best is None or row["ms_per_call"] < best["ms_per_call"]):
            best = row
    for warps, stages in TRITON_PIPELINES[1:] if best is not None else ():
        for mod in modules:
            mod.configure(best["block_n"], best["split_k"], warps, stages)
        row = {**_time_modules(modules, label, "triton", 1), "block_n": best["block_n"], "split_k": best["split_k"],
               "num_warps": warps, "num_stages": stages}
        tried.append(row)
        if "ms_per_call" in row and not launch_error(modules[0]) and row["ms_per_call"] < best["ms_per_call"]:
            best = row
    if best is not None:
        for mod in modules:
            mod.configure(best["block_n"], best["split_k"], best.get("num_warps", 4), best.get("num_stages", 2))
        best["chosen"] = True
    return tried


# --------------------------------------------------------------------------------------------------------- run
def machine() -> dict:
    import transformers

    props = torch.cuda.get_device_properties(0)
    info = {"platform": platform.platform(), "torch": torch.__version__, "transformers": transformers.__version__,
            "gpu": props.name, "multiprocessors": props.multi_processor_count, "cuda": torch.version.cuda}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def swap_kernel(model, lattice: dict, kernel: str) -> None:
    if kernel == "tinygemm":
        from tarq_deploy.runtimes.int4_linear import replace_linears

        replace_linears(model, lattice, device=DEVICE)
    elif kernel == "triton":
        from tarq_deploy.runtimes.triton_w4a16 import replace_linears_triton, triton_unavailable_reason

        reason = triton_unavailable_reason(DEVICE)
        if reason:
            raise RuntimeError(reason)
        replace_linears_triton(model, lattice, device=DEVICE)
    else:
        raise ValueError(f"unknown kernel {kernel!r}; one of {VARIANTS[1:]}")


def run(args: argparse.Namespace, save) -> dict:
    from tarq_deploy.quant.lattice import LatticeSpec

    from .gpu_voxtral import snap_layers

    t0 = time.perf_counter()
    result = {"benchmark": "gpu_decode", "measured": True, "machine": machine(), "config": vars(args).copy(),
              "variants": {}, "kernels": [], "errors": {}, "stages_s": {}}
    result["hbm"] = hbm_bandwidth()
    save(result)
    config = text_config(args.layers)
    model = build_text_model(config, args.seed, DEVICE)
    lattice = snap_layers(model.model.layers, "model.layers", LatticeSpec(4, args.group_size, scale_grid="bfloat16"))
    result["stages_s"]["build_and_snap"] = time.perf_counter() - t0
    context = torch.randint(1000, config.vocab_size, (1, args.context),
                            generator=torch.Generator().manual_seed(args.seed)).to(DEVICE)
    max_len = 64 * math.ceil((args.context + args.new_tokens + 8) / 64)
    glue = Glue.compiled() if args.glue == "compiled" else Glue.eager()
    reference = None
    for variant in ["fp16", *args.kernels]:
        t1 = time.perf_counter()
        try:
            if variant != "fp16":
                swap_kernel(model, lattice, variant)
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            fused = fused_linears(model, lattice, variant) if args.fuse else None
            dec = StaticDecoder(model, max_len, fused, glue)
            figures = {"weight_bytes_per_token": weight_bytes(model), "kv_bytes_per_token": dec.cache_bytes_read()}
            if variant == "triton" and args.tune:
                result["triton_tuning"] = tune_triton(model, fused)
            figures.update(decode_figures(dec, context, args.new_tokens, args.repeats))
            if reference is None:
                reference = reference_run(dec, context, args.agreement_steps)
            else:
                figures["agreement"] = agreement(forced_logits(dec, context, reference[0]), reference[1])
            figures["peak_vram_bytes"] = torch.cuda.max_memory_allocated()
            result["variants"][variant] = figures
            del dec
            save(result)
            result["kernels"] += kernel_times(model, "cublas-fp16" if variant == "fp16" else variant)
        except Exception as e:  # a variant failing must not lose the others
            result["errors"][variant] = f"{type(e).__name__}: {e}"
            print(f"{variant}: {result['errors'][variant]}")
        result["stages_s"][variant] = time.perf_counter() - t1
        summarize(result)
        save(result)
    return result


def summarize(result: dict) -> None:
    """Floors, speedups and the goal's verdict from what was measured so far."""
    bw = result["hbm"]["bytes_per_s"]
    fp16 = result["variants"].get("fp16", {}).get("graph_ms_per_token")
    for figures in result["variants"].values():
        read = figures["weight_bytes_per_token"] + figures["kv_bytes_per_token"]
        figures["floor_ms_per_token"] = read / bw * 1e3
        if "graph_ms_per_token" in figures:
            figures["achieved_bytes_per_s"] = read / (figures["graph_ms_per_token"] / 1e3)
            figures["of_floor"] = figures["floor_ms_per_token"] / figures["graph_ms_per_token"]
            if fp16:
                figures["speedup_vs_fp16"] = fp16 / figures["graph_ms_per_token"]
    speedups = {k: v["speedup_vs_fp16"] for k, v in result["variants"].items() if k != "fp16" and
                "speedup_vs_fp16" in v}
    result["goal"] = {"speedup_goal": SPEEDUP_GOAL, "speedups": speedups,
                      "met": bool(speedups) and max(speedups.values()) >= SPEEDUP_GOAL}


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"## Decode per token with CUDA graphs: Voxtral-Mini-3B language model ({result['config']['layers']} "
             f"layers), {m['gpu']}", "",
             f"HBM: {result['hbm']['bytes_per_s'] / 1e12:.2f} TB/s (device-to-device copy, read + written). "
             f"Context {result['config']['context']} tokens, {result['config']['new_tokens']} tokens per timed run, "
             f"median of {result['config']['repeats']}. q/k/v and gate/up fused: "
             f"{'yes' if result['config'].get('fuse') else 'no'}; glue between the Linears: "
             f"{result['config'].get('glue', 'eager')}.", "",
             "| variant | graph ms/token | eager ms/token | floor ms/token | of floor | speedup vs FP16 | "
             "weights read/token (MB) | KV read/token (MB) | peak VRAM (GiB) | prefill ms | logits rel. err | "
             "top-1 |", "|---|" + "---:|" * 11]
    for name, f in result["variants"].items():
        agree = f.get("agreement", {})
        cells = [name, _fmt(f.get("graph_ms_per_token"), 3), _fmt(f.get("eager_ms_per_token"), 2),
                 _fmt(f.get("floor_ms_per_token"), 3), _fmt(f.get("of_floor"), 2),
                 _fmt(f.get("speedup_vs_fp16"), 2), _fmt(f["weight_bytes_per_token"] / 1e6, 0),
                 _fmt(f["kv_bytes_per_token"] / 1e6, 1), _fmt(f.get("peak_vram_bytes", 0) / 2**30, 2),
                 _fmt(f.get("prefill_ms"), 1), _fmt(agree.get("relative_error"), 4, "e"),
                 _fmt(agree.get("top1_agreement"), 3)]
        lines.append("| " + " | ".join(cells) + " |")
    goal = result.get("goal", {})
    lines += ["", f"Goal INT4 >= {SPEEDUP_GOAL}x FP16 per token: {'met' if goal.get('met') else 'NOT met'} "
              f"({', '.join(f'{k} {v:.2f}x' for k, v in goal.get('speedups', {}).items()) or 'nothing measured'})."]
    if result["kernels"]:
        lines += ["", "### Per Linear (ms per call, all layers' modules of a shape in one graph)", "",
                  "| shape (N x K) | M | " + " | ".join(sorted({r['kernel'] for r in result['kernels']})) + " |",
                  "|---|---:|" + "---:|" * len({r['kernel'] for r in result['kernels']})]
        kernels = sorted({r["kernel"] for r in result["kernels"]})
        keys = sorted({(r["shape"], r["n_out"], r["k_in"], r["m"]) for r in result["kernels"]},
                      key=lambda key: (list(SHAPE_GROUPS).index(key[0]), key[3]))
        for shape, n, k, mm in keys:
            cells = []
            for kernel in kernels:
                row = next((r for r in result["kernels"] if (r["shape"], r["m"], r["kernel"]) == (shape, mm, kernel)),
                           None)
                cells.append("-" if row is None else row.get("error", "")[:30] or _fmt(row["ms_per_call"] * 1e3, 1)
                             + " us")
            lines.append(f"| {shape} ({n} x {k}) | {mm} | " + " | ".join(cells) + " |")
    for name, error in result["errors"].items():
        lines.append(f"- {name}: {error}")
    return "\n".join(lines) + "\n"


def _fmt(value, digits: int, style: str = "f") -> str:
    return "-" if value is None else f"{value:.{digits}{style}}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30, help="language-model decoder layers (real: 30)")
    parser.add_argument("--context", type=int, default=383, help="prefilled tokens (383: Voxtral's 30 s prompt)")
    parser.add_argument("--new-tokens", type=int, default=64, help="graph replays (tokens) per timed run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--agreement-steps", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--kernels", type=lambda s: [k for k in s.split(",") if k], default=list(VARIANTS[1:]),
                        help="INT4 kernels after FP16, in order: tinygemm, triton")
    parser.add_argument("--tune", action=argparse.BooleanOptionalAction, default=True,
                        help="pick the Triton launch per shape at M = 1 before measuring its decode")
    parser.add_argument("--fuse", action="store_true", help="q/k/v as one matrix and gate/up as one, every variant")
    parser.add_argument("--glue", choices=("eager", "compiled"), default="eager",
                        help="the element-wise work between the Linears: eager, or torch.compile'd (fused kernels)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-o", "--out", default="runs/bench/gpu_decode.json")
    args = parser.parse_args(argv)
    unknown = [k for k in args.kernels if k not in VARIANTS[1:]]
    if unknown:
        parser.error(f"unknown kernels {unknown}; choose from {VARIANTS[1:]}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("CUDA not available: nothing measured")
        return 0
    out = Path(args.out)

    def save(result: dict) -> None:
        write_json_atomic(out, result, indent=2)
        if result.get("variants"):
            write_text_atomic(out.with_suffix(".md"), markdown(result))

    result = run(args, save)
    print(markdown(result))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
