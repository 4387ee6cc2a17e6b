#!/usr/bin/env bash
# swarmkv bench serve at_once,one_by_one: the code before issue 42 (/work/before, venv /tmp/vb)
# and after (/work/main/.venv), alternated, the same libllama and llama-server.
set -euo pipefail
mkdir -p /tmp/cmpwd; cd /tmp/cmpwd
export SWARMKV_LIBLLAMA=/work/main/libllama/lib
rm -rf /tmp/cmp; mkdir -p /tmp/cmp
for round in 1 2; do
  order="before after"; [ "$round" = 2 ] && order="after before"
  for side in $order; do
    venv=/work/main/.venv; [ "$side" = before ] && venv=/tmp/vb
    echo "== round $round: $side" >&2
    $venv/bin/python -c "import swarmkv_ffi, sys; print('code from', swarmkv_ffi.__file__, file=sys.stderr)"
    $venv/bin/swarmkv bench serve --scenarios at_once,one_by_one --out /tmp/cmp/$side-$round 2>&1 | grep -E "ours|code from|rror" >&2
  done
done
