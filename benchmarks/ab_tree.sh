#!/usr/bin/env bash
# A change's before and after in one GPU call: the same benchmark in the working tree ("new") and in
# a copy with PATCH reversed ("old"), alternating old, new, old, new, ... so drift hits both alike.
#
#   git diff HEAD > ab.patch          # here: the uncommitted change (or `git diff REV` for a committed one)
#   bash benchmarks/ab_tree.sh ab.patch OUT_DIR ROUNDS python3 benchmarks/bench_ce_path.py --paths library
#
# Each run appends `--out OUT_DIR/{old,new}_R.csv` to the command and runs in its own tree, installed
# editable in turn (no network needed). The tree is installed as "new" again at the end.
set -eu
PATCH=$(realpath "$1"); OUTD=$(realpath -m "$2"); ROUNDS=$3; shift 3
NEW=$(pwd)
OLD=$(mktemp -d /tmp/ab_old.XXXX)
mkdir -p "$OUTD"
cp -r "$NEW/." "$OLD"
rm -rf "$OLD"/*.egg-info "$OLD"/build
(cd "$OLD" && patch -s -R -p1 < "$PATCH")
install() {  # quiet, unless it fails
    python3 -m pip install -q --no-deps --no-build-isolation -e "$1" >/tmp/ab_install.log 2>&1 || { cat /tmp/ab_install.log; exit 1; }
}
for r in $(seq 1 "$ROUNDS"); do
    for side in old new; do
        tree=$NEW; [ "$side" = old ] && tree=$OLD
        install "$tree"
        echo "== round $r: $side ($tree)"
        (cd "$tree" && "$@" --out "$OUTD/${side}_$r.csv")
    done
done
install "$NEW"
