"""llama.cpp's RPC server (what its `rpc-server -t N` does on a host with no accelerator), from the
llama-cpp-python wheel, for bench.rpc_bench.

The wheel ships libggml-rpc.so (when built with -DGGML_RPC=ON) but no `rpc-server` binary, so this
launcher loads the wheel's ggml libraries through ctypes and calls, with the CPU device,

    void ggml_backend_rpc_start_server(const char * endpoint, const char * cache_dir,
                                       size_t n_threads, size_t n_devices, ggml_backend_dev_t * devices);

(the five-argument form of the wheel's include/ggml-rpc.h, RPC protocol 7; older llama.cpp took the
devices' memory sizes as well). The call serves until the process is killed. It imports nothing of
llama_cpp's Python nor of ours, so it runs by path too:

    python bench/ggml_rpc_server.py --endpoint 10.0.0.2:50052 --threads 1
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
from pathlib import Path

GGML_BACKEND_DEVICE_TYPE_CPU = 0  # enum ggml_backend_dev_type, include/ggml-backend.h


def wheel_lib_dir() -> Path:
    """The llama-cpp-python wheel's lib/ folder (libggml*.so, libllama.so), found without importing it."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llama-cpp-python is not installed (pip install llama-cpp-python, built with -DGGML_RPC=ON)")
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib"
    if not (lib / "libggml-rpc.so").is_file():
        raise SystemExit(f"{lib}/libggml-rpc.so is missing: llama-cpp-python was built without -DGGML_RPC=ON")
    return lib


def serve(endpoint: str, threads: int) -> None:
    """Serve ggml RPC on `endpoint` (HOST:PORT) with this host's CPU device and `threads` threads; never returns."""
    lib = wheel_lib_dir()
    ggml = ctypes.CDLL(str(lib / "libggml.so"))
    rpc = ctypes.CDLL(str(lib / "libggml-rpc.so"))
    ggml.ggml_backend_dev_by_type.argtypes, ggml.ggml_backend_dev_by_type.restype = [ctypes.c_int], ctypes.c_void_p
    rpc.ggml_backend_rpc_start_server.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                                                  ctypes.POINTER(ctypes.c_void_p)]
    rpc.ggml_backend_rpc_start_server.restype = None
    cpu = ggml.ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)
    if not cpu:
        raise SystemExit("ggml has no CPU device")
    rpc.ggml_backend_rpc_start_server(endpoint.encode(), None, threads, 1, (ctypes.c_void_p * 1)(cpu))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--endpoint", required=True, help="HOST:PORT to listen on")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads of the server's compute")
    args = ap.parse_args()
    serve(args.endpoint, args.threads)


if __name__ == "__main__":
    main()
