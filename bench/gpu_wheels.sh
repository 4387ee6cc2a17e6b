#!/usr/bin/env bash
# Download, here, the wheels the lent GPU machine lacks, for gpu_check.sh to install there.
#
# That machine has Python 3.12 with numpy, numba, numba-cuda, nvidia-ml-py, pytest,
# tqdm, matplotlib, cmake, ninja and nvcc, and no network; the working tree travels to it
# (64 MiB at most). What swarmkv_ffi needs beyond that: cffi (and pycparser) for the
# binding, gguf (and PyYAML) to write the test model, pytest-timeout for the suite's
# timeouts; and llama.cpp's sources for the CUDA build (the pinned sdist is 77 MB, so
# DIR/llama-src.tar.xz is its vendor/llama.cpp without models/ and docs/, about 9 MB,
# taken from the checked sdist ./build_llama.sh extracted here). The total is checked.
#
#   bench/gpu_wheels.sh [DIR]       default DIR: bench/.wheels (git-ignored)
#
# There: gpu_check.sh installs the wheels with `pip install --no-index --target OUT/site`
# and builds with `./build_llama.sh --cuda --source-archive DIR/llama-src.tar.xz`.
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-bench/.wheels}"
py="${PYTHON:-.venv/bin/python}"
LIMIT_MB=24                               # well below the 64 MiB the working tree may take
WHEELS=(cffi pycparser gguf PyYAML pytest-timeout)

rm -rf "$dest"
mkdir -p "$dest"
"$py" -m pip download -q --no-deps --only-binary=:all: --dest "$dest" \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any "${WHEELS[@]}"
version=$(sed -n 's/^SDIST_VERSION=//p' build_llama.sh)
sha=$(sed -n 's/^SDIST_SHA256=//p' build_llama.sh)
src="${SWARMKV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/swarmkv-ffi}/src-$version"
[ -f "$src/.extracted" ] || { echo "gpu_wheels: no checked llama.cpp sources in $src: run ./build_llama.sh first" >&2; exit 1; }
stamp=$(mktemp -d)
echo "$sha" >"$stamp/.sdist-sha256"
tar -cJf "$dest/llama-src.tar.xz" -C "$src" --exclude=./models --exclude=./docs --exclude=./media \
    --exclude=./.github --exclude=./.extracted --exclude=./.sdist-sha256 . -C "$stamp" .sdist-sha256
rm -rf "$stamp"
size_kb=$(du -sk "$dest" | cut -f1)
ls -1 "$dest" >"$dest/WHEELS.txt"
echo "gpu_wheels: $(ls "$dest"/*.whl | wc -l) wheels, $((size_kb / 1024)) MiB in $dest:" >&2
sed 's/^/  /' "$dest/WHEELS.txt" >&2
[ "$size_kb" -le $((LIMIT_MB * 1024)) ] || { echo "gpu_wheels: more than $LIMIT_MB MiB" >&2; exit 1; }
for w in "${WHEELS[@]}"; do
    stem=$(echo "$w" | tr 'A-Z-' 'a-z_')
    grep -qi "^${stem}-" "$dest/WHEELS.txt" || { echo "gpu_wheels: no wheel for $w" >&2; exit 1; }
done
