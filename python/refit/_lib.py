"""ctypes bindings of refit's C ABI (include/refit/refit.h) in librefit.so.

The library is found, in this order: $REFIT_LIBRARY (a path to librefit.so), next to this
package (refit/librefit.so*, as a wheel would ship it), the CMake install prefix this package
was installed from (refit/_install_prefix.txt), then the dynamic loader's search path.
"""
import ctypes
import ctypes.util
import glob
import os

c_char_p = ctypes.c_char_p
c_int = ctypes.c_int
u32 = ctypes.c_uint32
u64 = ctypes.c_uint64
i32 = ctypes.c_int32
i64 = ctypes.c_int64


class Status(ctypes.Structure):
    _fields_ = [("ok", c_int), ("code", ctypes.c_char * 64), ("where", ctypes.c_char * 512),
                ("message", ctypes.c_char * 4096), ("text", ctypes.c_char * 4800)]


class HostOptions(ctypes.Structure):
    _fields_ = [("config_path", c_char_p), ("coordinator_host", c_char_p),
                ("coordinator_port", c_int), ("runtime_executable", c_char_p)]


class TensorDesc(ctypes.Structure):
    _fields_ = [("name", c_char_p), ("data", ctypes.c_void_p), ("bytes", u64), ("dtype", c_char_p),
                ("device", c_char_p), ("global_shape", ctypes.POINTER(i64)), ("ndim", u32),
                ("placement", c_int), ("row_begin", u64), ("rows", u64)]


class Publication(ctypes.Structure):
    _fields_ = [("publication_id", ctypes.c_char * 128), ("model_version", u64),
                ("manifest_fingerprint", ctypes.c_char * 80), ("tensors", u64), ("bytes", u64),
                ("chunks", u32), ("trainer_ranks", u32), ("tp", u32), ("attempts", u32),
                ("seconds", ctypes.c_double), ("peak_buffer_bytes", u64), ("receipts", u32)]


class SamplingParams(ctypes.Structure):
    _fields_ = [("n", u32), ("max_tokens", u32), ("temperature", ctypes.c_float), ("top_k", i32),
                ("top_p", ctypes.c_float), ("seed", u64), ("stop_token_ids", ctypes.POINTER(i32)),
                ("stop_count", u32), ("max_prompt_length", u32)]


class SampleInfo(ctypes.Structure):
    _fields_ = [("prompt_index", u32), ("token_count", u64), ("prompt_token_count", u64),
                ("finish_reason", ctypes.c_char * 16), ("prompt_truncated", c_int),
                ("model_version", u64)]


class RolloutStatus(ctypes.Structure):
    _fields_ = [("committed_version", u64), ("connection", ctypes.c_char * 16),
                ("needs_publication", c_int), ("sleep_level", u32), ("weights_awake", c_int),
                ("kv_cache_awake", c_int), ("publishing", c_int), ("epoch", u64),
                ("complete", c_int), ("last_error", ctypes.c_char * 2048)]


P = ctypes.POINTER
VP = ctypes.c_void_p
ST = P(Status)

_SIGNATURES = {
    "refit_version": (c_char_p, []),
    "refit_wire_protocol_version": (u32, []),
    "refit_host_create": (c_int, [P(HostOptions), P(VP), ST]),
    "refit_host_destroy": (None, [VP]),
    "refit_host_close": (c_int, [VP, ST]),
    "refit_host_register_rank": (c_int, [VP, u32, u32, c_char_p, ST]),
    "refit_host_register_synthetic": (c_int, [VP, u64, ST]),
    "refit_host_register_tensor": (c_int, [VP, P(TensorDesc), ST]),
    "refit_host_check_tensor": (c_int, [VP, c_char_p, VP, u64, ST]),
    "refit_host_model_tensor_count": (c_int, [VP, P(u64), ST]),
    "refit_host_model_tensor": (c_int, [VP, u64, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p,
                                        ctypes.c_size_t, P(i64), P(u32), ST]),
    "refit_host_connect": (c_int, [VP, ST]),
    "refit_host_step": (c_int, [VP, P(u64), ST]),
    "refit_host_publish": (c_int, [VP, u64, P(Publication), ST]),
    "refit_host_receipt_checksum_count": (c_int, [VP, u32, P(u64), ST]),
    "refit_host_receipt_checksum": (c_int, [VP, u32, u64, ctypes.c_char_p, ctypes.c_size_t,
                                            ctypes.c_char_p, ctypes.c_size_t, ST]),
    "refit_host_generate": (c_int, [VP, P(i32), P(u64), u64, P(SamplingParams), P(u64), P(u64), ST]),
    "refit_host_sample": (c_int, [VP, u64, P(SampleInfo), P(i32), P(ctypes.c_float), u64, P(i32),
                                  u64, ST]),
    "refit_host_sleep": (c_int, [VP, u32, P(RolloutStatus), ST]),
    "refit_host_wake": (c_int, [VP, c_int, c_int, P(RolloutStatus), ST]),
    "refit_host_status": (c_int, [VP, P(RolloutStatus), ST]),
    "refit_host_rank": (u32, [VP]),
    "refit_host_world": (u32, [VP]),
    "refit_host_connected": (c_int, [VP]),
}


def _candidates():
    env = os.environ.get("REFIT_LIBRARY")
    if env:
        yield env
        return
    here = os.path.dirname(os.path.abspath(__file__))
    for path in sorted(glob.glob(os.path.join(here, "librefit.so*"))):
        yield path
    prefix_file = os.path.join(here, "_install_prefix.txt")
    if os.path.exists(prefix_file):
        with open(prefix_file) as f:
            prefix = f.read().strip()
        for libdir in ("lib", "lib64", "lib/x86_64-linux-gnu", "lib/aarch64-linux-gnu"):
            path = os.path.join(prefix, libdir, "librefit.so")
            if os.path.exists(path):
                yield path
    found = ctypes.util.find_library("refit")
    if found:
        yield found


_lib = None


def lib():
    """The loaded librefit.so, with every entry point's signature declared."""
    global _lib
    if _lib is not None:
        return _lib
    tried = []
    for path in _candidates():
        try:
            handle = ctypes.CDLL(path)
        except OSError as e:
            tried.append("%s (%s)" % (path, e))
            continue
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(handle, name)
            fn.restype = restype
            fn.argtypes = argtypes
        _lib = handle
        return _lib
    raise OSError("refit: librefit.so not found; set REFIT_LIBRARY to its path (tried: %s)"
                  % (", ".join(tried) or "REFIT_LIBRARY, the package folder, the loader path"))
