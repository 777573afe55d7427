# Sourced by every script that builds into hvprobe's cache
# (${HVPROBE_CACHE:-$HOME/.cache/hvprobe}): the bundled guest, the lane's parts, the tests'
# Perfetto reader, the storm's snapshot. Its rules make a build safe to start several times
# at once (cargo test runs suites side by side) and again after one was killed:
#   - one builder of a part at a time: cache_lock, then look again whether the part is
#     there (another builder may have finished it while this one waited);
#   - a part appears whole or not at all: it is built in a temporary place beside its
#     final one and renamed into place (cache_publish, cache_write_file), so a reader
#     that does not lock never sees half of it;
#   - stdout carries the script's result and nothing else: cache_stdout_is_the_result
#     sends everything else to stderr, so that no tool's chatter ends up in a path a
#     caller reads (sha256sum -c prints its FAILED lines on stdout).

hvprobe_cache=${HVPROBE_CACHE:-$HOME/.cache/hvprobe}

# From here on, stdout is stderr; cache_result prints the one result line on the real one.
cache_stdout_is_the_result() {
    exec 3>&1 1>&2
}
cache_result() {
    printf '%s\n' "$1" >&3
}

# cache_lock FILE FD WHAT: an exclusive lock on FILE, held on descriptor FD until the
# script exits (the kernel drops it when the process dies, also when it is killed).
# Several locks need several descriptors; a script must not take the lock of a script
# it runs (another open of one file is another lock: it would wait for itself).
cache_lock() {
    local file=$1 fd=$2 what=$3
    mkdir -p "$(dirname "$file")"
    eval "exec $fd>\"\$file\""
    if ! flock -n "$fd"; then
        echo "hvprobe: waiting for another build of $what ($file)" >&2
        flock "$fd"
    fi
}

# cache_publish TMP DEST: TMP, a directory or file built whole, becomes DEST. Called
# with DEST's lock held; a reader without the lock may find DEST missing for a moment
# (then it takes the lock and looks again), never half of it.
cache_publish() {
    rm -rf "$2"
    mv -T "$1" "$2"
}

# cache_write_file DEST: stdin becomes DEST in one rename.
cache_write_file() {
    local tmp
    tmp=$(mktemp "$1.XXXXXX")
    cat >"$tmp"
    mv -f "$tmp" "$1"
}
