#!/usr/bin/env bash
# Build libllama + ggml as shared libraries from the llama.cpp sources pinned by the
# llama-cpp-python sdist on PyPI, and install them into ./libllama/ (git-ignored):
#   libllama/lib/*.so  libllama/include/llama.h  libllama/manifest.json
#
# Only the C library is used; the llama_cpp Python wrapper inside the sdist is not.
# The sdist and the CMake build folder live in a cache outside the clone
# (${SWARMKV_CACHE:-~/.cache/swarmkv-ffi}), so a second run, a second clone or CI is fast.
# A run whose pin and flags match the installed manifest does nothing.
set -euo pipefail

SDIST_NAME=llama-cpp-python
SDIST_VERSION=0.3.36
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
LLAMA_COMMIT=0c1e570          # vendor/llama.cpp inside that sdist (2026-10-01)

usage() {
    cat <<USAGE
usage: $0 [--portable|--baseline] [--amx] [--cuda] [--cuda-arch ARCHS] [--prefix DIR] [--tools]
       [--tools-min] [--source-archive FILE] [--jobs N] [--force] [--no-calibrate]

Builds libllama (llama.cpp ${LLAMA_COMMIT}, from ${SDIST_NAME}==${SDIST_VERSION}) into ./libllama/,
proves it with one real decode in a child process, then writes libllama/manifest.json.
The patches in kernels/ggml/ (exact mode's batch-invariant kernels) are applied first;
the build fails if one does not apply, and the manifest lists them.

By default the CPU code is compiled for this machine's CPU (-march=native) without
ggml's AMX path, and the manifest records the instruction sets it needs: swarmkv_ffi
refuses to load it on a CPU that lacks one (instead of dying with SIGILL).

  --portable         compile for any x86-64 with AVX2/FMA/F16C (any ARMv8 on arm64)
                     instead of this CPU: one build for every node of a cluster
  --baseline         compile for x86-64-v2: SSE4.2 and SSSE3, no AVX (128-bit vectors
                     where the default has 256 or 512): a second kernel set that rounds
                     differently, so tests can check that a claim does not hold by
                     accident of one instruction set (CI builds it with --prefix and runs
                     the fidelity-marked tests against it). x86-64 only
  --amx              keep ggml's AMX matmul path (Intel Sapphire Rapids and newer).
                     Known to die with SIGILL at this pin (see the comment below); off
                     by default
  --cuda             build the CUDA backend (GGML_CUDA=ON); needs nvcc
  --cuda-arch ARCHS  CUDA architectures, e.g. "90" or "80;90" (default: CMake's "native")
  --tools            also build llama.cpp's own tools with the same flags: llama-server,
                     llama-bench, llama-batched-bench and llama-quantize from the stock
                     pin into PREFIX/tools-stock/ (the peers our benchmarks compare us
                     with), and llama-bench and llama-batched-bench with our patches
                     into PREFIX/tools/ (\`swarmkv bench kernels\` runs both)
  --tools-min        only the stock llama-batched-bench and llama-quantize (into
                     PREFIX/tools-stock/): what bench/gpu_check.sh needs, in one tools
                     build instead of two (our patches are CPU kernels: on a GPU the
                     stock and patched tools compute alike)
  --prefix DIR       install into DIR instead of ./libllama (use it with SWARMKV_LIBLLAMA=DIR/lib)
  --source-archive F build from F instead of downloading the sdist: the pinned
                     vendor/llama.cpp without its models/ and docs/ (9 MB instead of 77),
                     made from the checked sdist by bench/gpu_wheels.sh, for a machine
                     without network; it must name this pin's sdist sha256
  --jobs N           parallel compile jobs (default: nproc)
  --force            rebuild even if the installed manifest matches
  --no-calibrate     do not time the attention kernels after the build (about
                     4 minutes on 2 cores, with its end-to-end check): the fast mode chooses between ggml's
                     kernels and ours by the rule built into kernels/ggml/0003, measured
                     on one CPU. \`swarmkv calibrate\` calibrates later; a build that
                     is already up to date is not re-calibrated, and one installed
                     again on the CPU that calibrated it reuses that table
  -h, --help         this text

Environment: SWARMKV_CACHE (cache folder), CMAKE (cmake binary), SWARMKV_NO_CALIBRATE=1
(as --no-calibrate).
USAGE
}

die() { echo "build_llama.sh: error: $*" >&2; exit 1; }
say() { echo "build_llama.sh: $*" >&2; }

backend=cpu; cuda_arch=""; jobs=$(nproc 2>/dev/null || echo 2); force=0
calibrate=1; [ "${SWARMKV_NO_CALIBRATE:-}" = 1 ] && calibrate=0
target=native; amx=0; prefix_arg=""; tools=0; archive=""
while [ $# -gt 0 ]; do
    case "$1" in
        --portable) target=portable ;;
        --baseline) target=baseline ;;
        --tools) tools=1 ;;
        --no-calibrate) calibrate=0 ;;
        --tools-min) tools=min ;;
        --amx) amx=1 ;;
        --cuda) backend=cuda ;;
        --cuda-arch) [ $# -ge 2 ] || die "--cuda-arch needs a value"; cuda_arch="$2"; shift ;;
        --prefix) [ $# -ge 2 ] || die "--prefix needs a value"; prefix_arg="$2"; shift ;;
        --source-archive) [ $# -ge 2 ] || die "--source-archive needs a file"; archive="$2"; shift ;;
        --jobs) [ $# -ge 2 ] || die "--jobs needs a value"; jobs="$2"; shift ;;
        --force) force=1 ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; die "unknown argument: $1" ;;
    esac
    shift
done
[ -n "$cuda_arch" ] && [ "$backend" != cuda ] && die "--cuda-arch only makes sense with --cuda"
[ $amx = 1 ] && [ $target != native ] && die "--amx goes only with the native build (AMX is not portable)"
[ $target = baseline ] && [ "$(uname -m)" != x86_64 ] && die "--baseline is an x86-64 target"

root=$(cd "$(dirname "$0")" && pwd)
prefix="${prefix_arg:-$root/libllama}"
case "$prefix" in /*) ;; *) prefix="$PWD/$prefix" ;; esac
cache="${SWARMKV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/swarmkv-ffi}"
CMAKE="${CMAKE:-cmake}"

# ---- tools ---------------------------------------------------------------------------
command -v "$CMAKE" >/dev/null || die "cmake not found; install it (apt-get install cmake, or pip install cmake)"
cmake_version=$("$CMAKE" --version | head -1 | awk '{print $3}')
printf '%s\n3.14\n' "$cmake_version" | sort -V -C 2>/dev/null && die "cmake $cmake_version is too old; llama.cpp needs >= 3.14 (pip install cmake)"
command -v cc >/dev/null || command -v gcc >/dev/null || die "no C compiler; install one (apt-get install build-essential)"
command -v c++ >/dev/null || command -v g++ >/dev/null || die "no C++ compiler; install one (apt-get install g++)"
if [ "$backend" = cuda ]; then
    command -v nvcc >/dev/null || die "--cuda needs nvcc on PATH (CUDA toolkit)"
fi
py=$(command -v python3 || command -v python) || die "python3 not found (needed to fetch the sdist with pip)"

# ---- CPU target ----------------------------------------------------------------------
# ggml's AMX path is left out of the default build. On an Intel Xeon (Sapphire Rapids,
# KVM guest, amx_tile/amx_int8/amx_bf16 in /proc/cpuinfo) a native build at this pin
# died with SIGILL at the first llama_decode, although the kernel grants AMX
# (arch_prctl XTILEDATA) and a standalone AMX program runs fine there:
#   SIGILL in tinygemm_kernel_amx<block_q8_1, block_q4_1, float, 32, 0>  tileloadd (%rax,%rsi,1),%tmm0
#     ggml_backend_amx_mul_mat <- ggml::cpu::amx::tensor_traits::compute_forward
#     <- ggml_cpu_extra_compute_forward <- ggml_graph_compute_thread (libgomp worker)
# ggml compiles that path only when __AMX_INT8__ is defined, so -mno-amx-* removes it
# (explicit -mno-* flags win over -march=native in GCC and Clang). --amx keeps it.
arch=$(uname -m)
cc_bin=$(command -v cc || command -v gcc)
cpu_cflags=""          # what we add to CMAKE_{C,CXX}_FLAGS
probe_cflags=""        # what the compiler sees for ggml-cpu, to list the features it uses
case "$arch-$target" in
    x86_64-native)
        probe_cflags="-march=native"
        if [ $amx = 0 ] && "$cc_bin" -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 -E - </dev/null >/dev/null 2>&1; then
            cpu_cflags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        fi ;;
    x86_64-portable) probe_cflags="-msse4.2 -mavx -mavx2 -mfma -mf16c -mbmi2" ;;
    x86_64-baseline) probe_cflags="-msse4.2 -mssse3 -mpopcnt" ;;
    aarch64-native|arm64-native) probe_cflags="-mcpu=native" ;;
    *-portable) probe_cflags="" ;;
    *) probe_cflags="-march=native" ;;
esac
probe_cflags="$probe_cflags $cpu_cflags"
# shellcheck disable=SC2086
cpu_features=$("$cc_bin" $probe_cflags -dM -E - </dev/null 2>/dev/null | "$py" "$root/swarmkv_ffi/cpu.py" --from-macros) \
    || die "could not list the CPU features '$cc_bin $probe_cflags' enables"
# shellcheck disable=SC2086
missing=$("$py" "$root/swarmkv_ffi/cpu.py" --missing $cpu_features) \
    || die "the compiler targets features this CPU does not report ($missing); use --portable"

# ---- flags and the idempotence key ---------------------------------------------------
flags=(
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=ON
    -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
    -DLLAMA_BUILD_MTMD=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
    -DGGML_OPENMP=ON
    # llamafile's sgemm computes batched matmuls with another summation order than
    # ggml's per-row dot products; off, a token's logits do not depend on what else
    # shares its batch, so shared-mode branches can match plain runs bit for bit.
    -DGGML_LLAMAFILE=OFF
    # libllama finds its ggml libraries beside itself, wherever the folder is moved.
    -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=$ORIGIN'
)
if [ $target = native ]; then
    flags+=(-DGGML_NATIVE=ON)
else
    flags+=(-DGGML_NATIVE=OFF)
    case "$arch-$target" in
        x86_64-portable) flags+=(-DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                                 -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF) ;;
        x86_64-baseline) flags+=(-DGGML_SSE42=ON -DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF
                                 -DGGML_BMI2=OFF -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF) ;;
    esac
fi
[ -n "$cpu_cflags" ] && flags+=("-DCMAKE_C_FLAGS=$cpu_cflags" "-DCMAKE_CXX_FLAGS=$cpu_cflags")
if [ "$backend" = cuda ]; then
    flags+=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${cuda_arch:-native}")
fi
# ---- our patches to the pinned sources (kernels/ggml/*.patch, applied in name order) --
patches=("$root"/kernels/ggml/*.patch)
[ -e "${patches[0]}" ] || die "no patches found in $root/kernels/ggml/ (a broken checkout?)"
patch_set=$(cat "${patches[@]}" | sha256sum | cut -c1-16)
if command -v patch >/dev/null; then apply=patch
elif command -v git >/dev/null; then apply=git
else die "the 'patch' program (or git) is needed to apply kernels/ggml/*.patch (apt-get install patch)"; fi

# The CPU features are part of the key: a cache or clone moved to another CPU rebuilds.
key=$(printf '%s\n' "$SDIST_SHA256" "${flags[@]}" "$cpu_features" "$patch_set" | sha256sum | cut -c1-16)
# The stock tools are built from the pristine pin: a new patch set does not rebuild them.
stock_key=$(printf '%s\n' "$SDIST_SHA256" "${flags[@]}" "$cpu_features" | sha256sum | cut -c1-16)
manifest="$prefix/manifest.json"

lib_ready=0
if [ $force = 0 ] && [ -f "$manifest" ] && grep -q "\"build_key\": \"$key\"" "$manifest" \
   && [ -f "$prefix/lib/libllama.so" ] && [ -f "$prefix/include/llama.h" ]; then
    lib_ready=1
    if [ $tools = 0 ] || { [ $tools = 1 ] && [ -x "$prefix/tools/llama-batched-bench" ] && [ -x "$prefix/tools-stock/llama-server" ]; } \
       || { [ $tools = min ] && [ -x "$prefix/tools-stock/llama-batched-bench" ] && [ -x "$prefix/tools-stock/llama-quantize" ]; }; then
        say "up to date ($backend, $target CPU build, llama.cpp $LLAMA_COMMIT)"
        echo "$prefix/lib/libllama.so"
        exit 0
    fi
fi

# ---- source: the sdist, checked (or a trimmed archive of it) ---------------------------
src="$cache/src-$SDIST_VERSION"
if [ -n "$archive" ] && [ ! -f "$src/.extracted" ]; then
    [ -f "$archive" ] || die "--source-archive $archive: no such file"
    say "extracting the trimmed llama.cpp sources from $archive"
    rm -rf "$src"; mkdir -p "$src"
    tar xJf "$archive" -C "$src" || die "could not extract $archive"
    [ "$(cat "$src/.sdist-sha256" 2>/dev/null)" = "$SDIST_SHA256" ] \
        || { rm -rf "$src"; die "$archive was not made from ${SDIST_NAME}==${SDIST_VERSION} (sha256 $SDIST_SHA256); remake it with bench/gpu_wheels.sh"; }
    touch "$src/.extracted"
fi
if [ ! -f "$src/.extracted" ]; then
    mkdir -p "$cache/sdist"
    tarball="$cache/sdist/llama_cpp_python-${SDIST_VERSION}.tar.gz"
    if [ ! -f "$tarball" ]; then
        say "downloading ${SDIST_NAME}==${SDIST_VERSION} source distribution from PyPI"
        "$py" -m pip download --quiet --no-binary :all: --no-deps \
            "${SDIST_NAME}==${SDIST_VERSION}" -d "$cache/sdist" 2>&1 | tail -5 >&2 \
            || true
        [ -f "$tarball" ] || die "could not download ${SDIST_NAME}==${SDIST_VERSION} from PyPI; is the registry reachable (pip config, proxy)? You can also place the file at $tarball, or build from a --source-archive"
    fi
    got=$(sha256sum "$tarball" | cut -d' ' -f1)
    if [ "$got" != "$SDIST_SHA256" ]; then
        rm -f "$tarball"
        die "sha256 mismatch for $(basename "$tarball"): got $got, want $SDIST_SHA256 (removed it; run again to re-download)"
    fi
    say "extracting vendor/llama.cpp"
    rm -rf "$src"; mkdir -p "$src"
    tar xzf "$tarball" -C "$src" --strip-components=3 "llama_cpp_python-${SDIST_VERSION}/vendor/llama.cpp" \
        || die "could not extract vendor/llama.cpp from $tarball"
    rm -f "$src/.git"   # a submodule pointer into a .git we do not have
    echo "$SDIST_SHA256" >"$src/.sdist-sha256"
    touch "$src/.extracted"
fi
pristine="$src"
apply_patch() {  # PATCH: apply it to $src with patch(1), or with git apply where patch is missing
    if [ "$apply" = patch ]; then patch -p1 --batch --forward --silent -d "$src" <"$1"
    else (cd "$src" && git apply -p1 --unsafe-paths "$1"); fi
}
# One patched tree whatever the patch set (its .patched names the set it holds): the
# source paths stay the same from one patch set to the next, so ccache recompiles only
# the files a patch changed.
src="$cache/src-$SDIST_VERSION-patched"
if [ "$(cat "$src/.patched" 2>/dev/null)" != "$patch_set" ]; then
    say "applying ${#patches[@]} patches from kernels/ggml/"
    rm -rf "$src"; cp -a "$pristine" "$src"
    for p in "${patches[@]}"; do
        apply_patch "$p" >"$cache/patch.log" 2>&1 \
            || { cat "$cache/patch.log" >&2; rm -rf "$src"; die "$(basename "$p") does not apply to llama.cpp $LLAMA_COMMIT (see above); fix the patch or the pin"; }
    done
    echo "$patch_set" >"$src/.patched"
fi

# ---- configure, build, install -------------------------------------------------------
build="$cache/build-$key"
launcher=()
if command -v ccache >/dev/null; then
    launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
    [ "$backend" = cuda ] && launcher+=(-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
    say "using ccache"
fi

# llama.cpp's own tools, from the same flags, twice: PREFIX/tools/ from our patched
# sources (what our kernels give llama.cpp's own benchmarks) and PREFIX/tools-stock/ from
# the pristine pin (the yardstick). Each folder holds its own copies of the libraries.
build_tools_from() {   # SOURCE DEST-FOLDER BUILD-DIR TARGET...
    local tsrc="$1" dest="$2" tb="$3"; shift 3
    local targets=("$@") t
    local tflags=("${flags[@]}" -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON)
    say "configuring llama.cpp's tools in $tb"
    "$CMAKE" -S "$tsrc" -B "$tb" "${tflags[@]}" "${launcher[@]}" >"$tb.configure.log" 2>&1 \
        || { tail -30 "$tb.configure.log" >&2; die "cmake configure of the tools failed; log: $tb.configure.log"; }
    say "compiling ${targets[*]} into $dest (several minutes on a small machine)"
    "$CMAKE" --build "$tb" --config Release -j "$jobs" --target "${targets[@]}" \
        >"$tb.build.log" 2>&1 \
        || { tail -30 "$tb.build.log" >&2; die "compiling the tools failed; log: $tb.build.log"; }
    rm -rf "$dest"; mkdir -p "$dest"
    for t in "${targets[@]}"; do cp "$tb/bin/$t" "$dest/"; done
    find "$tb/bin" "$tb/src" "$tb/ggml/src" "$tb/common" -maxdepth 3 -name '*.so*' -exec cp -P {} "$dest/" \; 2>/dev/null
    "$dest/${targets[0]}" --help >/dev/null 2>&1 || die "the freshly built $dest/${targets[0]} does not run"
}
build_tools() {
    if [ $tools = min ]; then
        build_tools_from "$pristine" "$prefix/tools-stock" "$cache/tools-stock-$stock_key" llama-batched-bench llama-quantize
        say "tools installed into $prefix/tools-stock (stock llama.cpp $LLAMA_COMMIT)"
        return
    fi
    build_tools_from "$src" "$prefix/tools" "$cache/tools-$key" llama-bench llama-batched-bench
    build_tools_from "$pristine" "$prefix/tools-stock" "$cache/tools-stock-$stock_key" llama-server llama-bench llama-batched-bench llama-quantize
    say "tools installed into $prefix/tools (patched) and $prefix/tools-stock (stock llama.cpp $LLAMA_COMMIT)"
}
if [ $lib_ready = 1 ]; then   # only the tools were missing
    build_tools
    echo "$prefix/lib/libllama.so"
    exit 0
fi

say "configuring ($backend) in $build"
"$CMAKE" -S "$src" -B "$build" "${flags[@]}" "${launcher[@]}" \
    -DCMAKE_INSTALL_PREFIX="$prefix" -DCMAKE_INSTALL_LIBDIR=lib >"$cache/configure-$key.log" 2>&1 \
    || { tail -30 "$cache/configure-$key.log" >&2; die "cmake configure failed; full log: $cache/configure-$key.log"; }
say "compiling with $jobs jobs (first build takes several minutes on a small machine)"
"$CMAKE" --build "$build" --config Release -j "$jobs" --target llama >"$cache/build-$key.log" 2>&1 \
    || { tail -30 "$cache/build-$key.log" >&2; die "compile failed; full log: $cache/build-$key.log"; }

# Install into a staging folder; it replaces ./libllama only after the smoke decode.
stage="$prefix.new"
rm -rf "$stage"; mkdir -p "$stage/lib" "$stage/include"
# Copy the shared objects (with their version symlinks) and the public headers.
find "$build/bin" "$build/src" "$build/ggml/src" -maxdepth 3 -name '*.so*' -exec cp -P {} "$stage/lib/" \; 2>/dev/null
cp "$src/include/llama.h" "$stage/include/"
cp "$src"/ggml/include/*.h "$stage/include/"
[ -f "$stage/lib/libllama.so" ] || die "build finished but libllama.so was not found under $build"
# The kernel calibrator (tools/fa_calibrate.c), installed with the library it measures.
mkdir -p "$stage/bin"
"$cc_bin" -O2 -o "$stage/bin/fa_calibrate" "$root/tools/fa_calibrate.c" -I"$stage/include" -L"$stage/lib" \
    -lggml-cpu -lggml-base -lggml -lm -Wl,-rpath,'$ORIGIN/../lib' 2>"$cache/fa_calibrate-$key.log" \
    || { cat "$cache/fa_calibrate-$key.log" >&2; die "could not compile tools/fa_calibrate.c against the new build"; }
# Its end-to-end check (tools/fa_check.c): a whole model's decode with each kernel.
"$cc_bin" -O2 -o "$stage/bin/fa_check" "$root/tools/fa_check.c" -I"$stage/include" -L"$stage/lib" \
    -lllama -lggml-cpu -lggml-base -lggml -lm -Wl,-rpath,'$ORIGIN/../lib' 2>"$cache/fa_check-$key.log" \
    || { cat "$cache/fa_check-$key.log" >&2; die "could not compile tools/fa_check.c against the new build"; }

# ---- prove it ------------------------------------------------------------------------
if [ $amx = 0 ] && command -v objdump >/dev/null; then
    n_amx=$(objdump -d "$stage"/lib/libggml-cpu*.so 2>/dev/null | grep -cE '\b(tileloadd|tdpbusd|tdpbssd|tdpbf16ps|ldtilecfg)\b' || true)
    [ "$n_amx" = 0 ] || die "the CPU library still contains $n_amx AMX tile instructions; the -mno-amx-* flags did not take (compiler: $cc_bin)"
fi
say "smoke decode through the new library (tiny model, child process)"
"$root/tools/smoke_check.sh" "$stage" || { rm -rf "$stage"; die "not installed: the new libllama failed its smoke decode (the previous ./libllama, if any, is untouched)"; }

rm -rf "$prefix"; mv "$stage" "$prefix"
header_sha=$(sha256sum "$prefix/include/llama.h" | cut -d' ' -f1)
flags_json=$(printf '"%s",' "${flags[@]}"); flags_json="[${flags_json%,}]"
features_json=""
for f in $cpu_features; do features_json="$features_json\"$f\","; done
features_json="[${features_json%,}]"
patches_json=""
for p in "${patches[@]}"; do patches_json="$patches_json\"$(basename "$p")\","; done
patches_json="[${patches_json%,}]"
built_on=$(grep -m1 '^model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//;s/"//g')
cat >"$manifest" <<JSON
{
  "llama_cpp_commit": "$LLAMA_COMMIT",
  "source": "${SDIST_NAME}==${SDIST_VERSION}",
  "source_sha256": "$SDIST_SHA256",
  "backend": "$backend",
  "cuda_arch": "${cuda_arch}",
  "cpu_target": "$target",
  "cpu_arch": "$arch",
  "cpu_features": $features_json,
  "amx": $([ $amx = 1 ] && echo true || echo false),
  "built_on": "$built_on",
  "build_flags": $flags_json,
  "build_key": "$key",
  "patch_set": "$patch_set",
  "patches": $patches_json,
  "llama_h_sha256": "$header_sha",
  "built_at": "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
}
JSON
say "installed into $prefix ($target CPU build; needs: ${cpu_features:-nothing beyond the base ISA})"
# Which attention kernel the fast mode takes, measured on this CPU (a failure keeps the
# built-in rule; the build stands).
if [ $calibrate = 1 ] && [ "$backend" = cpu ]; then
    say "calibrating the attention kernel choice on this CPU (skip with --no-calibrate)"
    # The check decodes a random-weight twin of the packaged model (not installed yet),
    # written once into the cache by the python the smoke check used.
    twin="$cache/twin-smollm2-135m.gguf"
    if [ ! -s "$twin" ]; then
        if "${SWARMKV_SMOKE_PYTHON:-$cache/tools-venv/bin/python}" "$root/swarmkv_ffi/tiny_gguf.py" \
            "$twin.tmp" --like smollm2-135m >/dev/null; then mv "$twin.tmp" "$twin"
        else rm -f "$twin.tmp"; say "warning: could not write the model twin; the kernel table is not checked end to end"; fi
    fi
    check=(); [ -s "$twin" ] && check=(--check-model "$twin")
    "$py" "$root/swarmkv_ffi/calibration.py" "$prefix" ${check[@]+"${check[@]}"} --reuse "$cache/calibration-$key.json" \
        || say "warning: calibration failed; the fast mode keeps the built-in kernel rule (swarmkv calibrate retries)"
fi
[ $tools != 0 ] && build_tools
echo "$prefix/lib/libllama.so"
