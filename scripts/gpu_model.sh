#!/usr/bin/env bash
# Split a model file into parts that travel in separate device calls, and join them back.
#
#   scripts/gpu_model.sh split FILE DIR [NUM_PARTS]   # DIR/part.00 ... + DIR/MANIFEST
#   scripts/gpu_model.sh join DIR OUT_FILE            # checks every part and the sha256
#   scripts/gpu_model.sh stash DIR STASH              # DIR's parts <-> STASH (see below)
#
# MANIFEST (one `key=value` a line): name (the file's base name), size, sha256 (of the
# whole file), parts (the part names, in order). `join` names the missing parts and exits 3
# when some are absent, 4 when the joined file's sha256 differs.
set -euo pipefail

die() { echo "gpu_model.sh: $*" >&2; exit "${2:-1}"; }

manifest_get() {  # manifest_get DIR KEY
    sed -n "s/^$2=//p" "$1/MANIFEST"
}

cmd_split() {
    local file=$1 dir=$2 n=${3:-2}
    [[ -f $file ]] || die "no such file: $file"
    mkdir -p "$dir"
    rm -f "$dir"/part.* "$dir/MANIFEST"
    split -n "$n" -d -a 2 "$file" "$dir/part."
    {
        echo "name=$(basename "$file")"
        echo "size=$(stat -c %s "$file")"
        echo "sha256=$(sha256sum "$file" | cut -d' ' -f1)"
        echo "parts=$(cd "$dir" && ls part.* | tr '\n' ' ' | sed 's/ $//')"
    } >"$dir/MANIFEST"
}

cmd_join() {
    local dir=$1 out=$2
    [[ -f $dir/MANIFEST ]] || die "no MANIFEST in $dir" 3
    local parts missing=() p
    read -r -a parts <<<"$(manifest_get "$dir" parts)"
    for p in "${parts[@]}"; do
        [[ -f $dir/$p ]] || missing+=("$p")
    done
    ((${#missing[@]} == 0)) || die "missing parts in $dir: ${missing[*]}" 3
    mkdir -p "$(dirname "$out")"
    (cd "$dir" && cat "${parts[@]}") >"$out.partial"
    local want got
    want=$(manifest_get "$dir" sha256)
    got=$(sha256sum "$out.partial" | cut -d' ' -f1)
    if [[ $got != "$want" ]]; then
        rm -f "$out.partial"
        die "sha256 of the joined file is $got, MANIFEST says $want" 4
    fi
    mv "$out.partial" "$out"
}

# `stash` keeps the parts in a second place outside the repository (gpu_check.sh uses /tmp):
# each call copies DIR's parts there, and those it lacks back from there, so a part carried by
# an earlier call reaches the join whatever the next call's tree copy does to DIR. A stash
# made for another file (its MANIFEST differs) is emptied first.
cmd_stash() {
    local dir=$1 stash=$2 p
    [[ -f $dir/MANIFEST ]] || return 0
    mkdir -p "$stash"
    if ! cmp -s "$dir/MANIFEST" "$stash/MANIFEST"; then
        rm -f "$stash"/part.* && cp "$dir/MANIFEST" "$stash/MANIFEST"
    fi
    for p in "$dir"/part.*; do
        [[ -f $p && ! -f $stash/${p##*/} ]] && cp "$p" "$stash/"
    done
    for p in "$stash"/part.*; do
        [[ -f $p && ! -f $dir/${p##*/} ]] && cp "$p" "$dir/" && echo "part ${p##*/}: from $stash"
    done
    return 0
}

case ${1:-} in
    split) shift; (($# >= 2)) || die "usage: split FILE DIR [NUM_PARTS]"; cmd_split "$@" ;;
    join) shift; (($# == 2)) || die "usage: join DIR OUT_FILE"; cmd_join "$@" ;;
    stash) shift; (($# == 2)) || die "usage: stash DIR STASH"; cmd_stash "$@" ;;
    *) die "usage: gpu_model.sh split FILE DIR [NUM_PARTS] | join DIR OUT_FILE | stash DIR STASH" ;;
esac
