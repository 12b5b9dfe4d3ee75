"""Direct calls into the crispasr wheel's voxtral backend (libcrispasr.so, C API of src/voxtral.cpp) for the tests:
mel, encoder + projector, token embeddings and the KV-cached decoder's last-position logits, so a Voxtral GGUF can
be compared with PyTorch on a forced prompt. The Session API only returns text."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np


class Params(ctypes.Structure):
    # voxtral_context_params in crispasr 0.8.45 (voxtral_context_default_params returns {4, 1, true, true})
    _fields_ = [("n_threads", ctypes.c_int), ("verbosity", ctypes.c_int), ("use_gpu", ctypes.c_bool),
                ("flag", ctypes.c_bool)]


def _lib() -> ctypes.CDLL:
    import crispasr

    lib = ctypes.CDLL(str(Path(crispasr.__file__).parent / "libcrispasr.so"))
    f, i, p = ctypes.POINTER(ctypes.c_float), ctypes.c_int, ctypes.c_void_p
    ip = ctypes.POINTER(ctypes.c_int)
    lib.voxtral_context_default_params.restype = Params
    lib.voxtral_init_from_file.argtypes, lib.voxtral_init_from_file.restype = [ctypes.c_char_p, Params], p
    lib.voxtral_free.argtypes = [p]
    lib.voxtral_compute_mel.argtypes, lib.voxtral_compute_mel.restype = [p, f, i, ip, ip], f
    lib.voxtral_run_encoder.argtypes, lib.voxtral_run_encoder.restype = [p, f, i, i, ip, ip], f
    lib.voxtral_embed_tokens.argtypes = [p, ctypes.POINTER(ctypes.c_int32), i]
    lib.voxtral_embed_tokens.restype = f
    lib.voxtral_kv_init.argtypes, lib.voxtral_kv_init.restype = [p, i], ctypes.c_bool
    lib.voxtral_run_llm_kv.argtypes, lib.voxtral_run_llm_kv.restype = [p, f, i, i, ip, ip], f
    lib.free.argtypes = [p]
    return lib


class VoxtralGGML:
    def __init__(self, path: str | Path, threads: int = 1) -> None:
        self.lib = _lib()
        params = self.lib.voxtral_context_default_params()
        params.n_threads, params.verbosity, params.use_gpu = threads, 0, False
        self.ctx = self.lib.voxtral_init_from_file(str(path).encode(), params)
        if not self.ctx:
            raise RuntimeError(f"voxtral_init_from_file failed for {path}")

    def close(self) -> None:
        if self.ctx:
            self.lib.voxtral_free(self.ctx)
            self.ctx = None

    def _take(self, ptr, n: int) -> np.ndarray:
        if not ptr:
            raise RuntimeError("the voxtral backend returned NULL")
        out = np.ctypeslib.as_array(ptr, shape=(n,)).copy()
        self.lib.free(ctypes.cast(ptr, ctypes.c_void_p))
        return out

    def mel(self, audio: np.ndarray) -> np.ndarray:
        audio = np.ascontiguousarray(audio, dtype=np.float32)
        n_mels, frames = ctypes.c_int(), ctypes.c_int()
        ptr = self.lib.voxtral_compute_mel(self.ctx, audio.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), len(audio),
                                           ctypes.byref(n_mels), ctypes.byref(frames))
        return self._take(ptr, n_mels.value * frames.value).reshape(n_mels.value, frames.value)

    def encode(self, mel: np.ndarray) -> np.ndarray:
        mel = np.ascontiguousarray(mel, dtype=np.float32)
        n, dim = ctypes.c_int(), ctypes.c_int()
        ptr = self.lib.voxtral_run_encoder(self.ctx, mel.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                           mel.shape[0], mel.shape[1], ctypes.byref(n), ctypes.byref(dim))
        return self._take(ptr, n.value * dim.value).reshape(n.value, dim.value)

    def embed(self, ids: list[int], hidden: int) -> np.ndarray:
        arr = (ctypes.c_int32 * len(ids))(*ids)
        return self._take(self.lib.voxtral_embed_tokens(self.ctx, arr, len(ids)), len(ids) * hidden).reshape(
            len(ids), hidden)

    def kv_init(self, max_ctx: int) -> None:
        if not self.lib.voxtral_kv_init(self.ctx, max_ctx):
            raise RuntimeError("voxtral_kv_init failed")

    def step(self, embeds: np.ndarray, n_past: int) -> np.ndarray:
        """Last-position logits after feeding ``embeds`` [n, hidden] at positions n_past..n_past+n-1."""
        embeds = np.ascontiguousarray(embeds, dtype=np.float32)
        n_out, vocab = ctypes.c_int(), ctypes.c_int()
        ptr = self.lib.voxtral_run_llm_kv(self.ctx, embeds.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                          embeds.shape[0], n_past, ctypes.byref(n_out), ctypes.byref(vocab))
        if not ptr:
            raise RuntimeError("voxtral_run_llm_kv returned NULL")
        return self._take(ptr, vocab.value)
