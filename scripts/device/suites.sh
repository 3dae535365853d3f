# Sourced by run_a.sh, run_b.sh and run_c.sh on the device, from the tree's root, with the bundle
# in .device/ (docs/integrations-vllm-pages.md, "what is still to run"): unpacks each tree NAME whose
# NAME-src.tar.xz (git archive) and NAME-aot.tar.xz (its AOT modules) are there, once per machine;
# `in_tree TREE CMD...` runs CMD in that tree with its modules; `suite TREE NAME SECONDS ARGS...`
# runs GPU tests there, the whole output (failures' messages included) in $OUT/TREE-NAME.txt.
# The time limit sends SIGINT, so a stopped pytest still prints its summary.
set -u
D=$PWD/.device
source $D/prelude.sh || exit 1
export PYTHONUNBUFFERED=1 REPLAYSSM_MAX_JOBS=16 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
T0=$(date +%s)
unpack() {
  [ -f $D/$1-src.tar.xz ] || return 0
  mkdir -p /tmp/$1 /tmp/aot-$1
  [ -f /tmp/$1/.ok ] && return
  tar xJf $D/$1-src.tar.xz -C /tmp/$1 && { [ ! -f $D/$1-aot.tar.xz ] || tar xJf $D/$1-aot.tar.xz -C /tmp/aot-$1; } \
    && touch /tmp/$1/.ok
}
for tree in main combo old nan vl r64; do unpack $tree; done
elapsed() { echo "$(( $(date +%s) - T0 )) s"; }
in_tree() {
  local tree=$1
  shift
  (cd /tmp/$tree && PYTHONPATH=/tmp/$tree:/tmp/site REPLAYSSM_AOT_DIR=/tmp/aot-$tree "$@")
}
suite() {
  local tree=$1 name=$2 t=$3 f=$OUT/$1-$2.txt
  shift 3
  in_tree $tree timeout -s INT -k 20 $t python3 -m pytest -p no:cacheprovider -m gpu -rfE -q "$@" > $f 2>&1
  echo "rc=$?" >> $f
  echo "== $tree $name at $(elapsed): $(grep -E '[0-9]+ (passed|failed)' $f | tail -1)"
}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader > $OUT/device.txt
