# Shared steps of the hack/*/build.sh scripts that build Go binaries from the Go module proxy
# into a cache outside the repo (source it; it sets no shell options):
#   ${INSTASLICE_CACHE:-$HOME/.cache/instaslice}/<thing>/<version>-<key>/{bin,...,build.log,.stamp}
#
# A script pins its module in a go.mod, names its cache dir (gobuild_dir), defines a check that
# its cached copy is whole, then calls gobuild_begin (returns at once, printing what the script
# prints, when the check passes; else it takes the dir's lock and starts the log), builds into
# <dir>.tmp dirs with gobuild_go, smoke-checks them, and calls gobuild_promote and gobuild_finish.
#
# The key: each script hashes only what decides its output (go.sum, go.mod, versions, ldflags,
# the files it copies), never its own text or this file's, so moving code between the scripts
# and here does not make a warm cache cold (a cold Kueue build takes ~15 min on 2 cores).

export GOTOOLCHAIN=local CGO_ENABLED=0
GO="${GO:-go}"

# gobuild_pin GO.MOD MODULE: the version GO.MOD requires MODULE at; fails, saying so, if none.
gobuild_pin() {
    local v
    v="$(sed -n "s#^require $2 \(v[^ ]*\)\$#\1#p; s#^\t$2 \(v[^ ]*\).*#\1#p" "$1" | head -n1)"
    [[ -n "$v" ]] || { echo "cannot read the $2 pin from $1" >&2; return 1; }
    echo "$v"
}

# gobuild_key < INPUTS: the 12 hex digits of a cache dir's name.
gobuild_key() { sha256sum | cut -c1-12; }

# gobuild_dir THING VERSION KEY: the cache dir; sets OUT, STAMP and LOG to it, its .stamp, its build.log.
gobuild_dir() {
    OUT="${INSTASLICE_CACHE:-$HOME/.cache/instaslice}/$1/$2-$3"
    STAMP="$OUT/.stamp"
    LOG="$OUT/build.log"
}

# gobuild_print CHECK PRINT WHAT: for --print-dir / --print-bindir: print PRINT and exit 0 if
# CHECK passes, else say WHAT is not built and exit 1.
gobuild_print() {
    "$1" || { echo "$3 not built (or the cached copy is damaged); run make kube-bins" >&2; exit 1; }
    echo "$2"
    exit 0
}

# gobuild_begin CHECK PRINT WHAT [HINT]: if CHECK passes (now, or after waiting for another
# process's build of OUT), print PRINT and exit 0. Else hold OUT's lock (fd 9) until the script
# exits, remove the stamp, start the log and a line of progress every 30 s; sets START.
gobuild_begin() {
    local check="$1" print="$2" what="$3" hint="${4:-}"
    if "$check"; then echo "$print"; exit 0; fi
    mkdir -p "$OUT"
    exec 9>"$OUT/.lock"
    if ! flock -n 9; then echo "waiting for another build of $OUT ..." >&2; flock 9; fi
    if "$check"; then echo "$print"; exit 0; fi  # another process finished it while we waited
    rm -f "$STAMP"
    START=$(date +%s)
    : >"$LOG"
    echo "building $what into $OUT (${hint:+$hint; }log $LOG)" >&2
    ( while sleep 30; do echo "  ... $(( $(date +%s) - START ))s elapsed, $(grep -c . "$LOG" || true) packages built" >&2; done ) &
    GOBUILD_TICKER=$!
    trap 'kill "$GOBUILD_TICKER" 2>/dev/null || true' EXIT
}

# gobuild_go DIR ARGS...: `go build -v -trimpath ARGS` in module mode inside DIR, logged to LOG;
# on failure print the log's tail and exit 1.
gobuild_go() {
    (cd "$1" && GOFLAGS=-mod=mod "$GO" build -v -trimpath "${@:2}") 2>>"$LOG" || { tail -n 40 "$LOG" >&2; exit 1; }
}

# gobuild_mod_dir DIR MODULE: where the Go module cache holds MODULE, as DIR's go.mod resolves it.
gobuild_mod_dir() { (cd "$1" && GOFLAGS=-mod=mod "$GO" list -m -f '{{.Dir}}' "$2"); }

# gobuild_release_time DIR MODULE: MODULE's release time on the module proxy (a reproducible build date).
gobuild_release_time() {
    sed -n 's/.*"Time":"\([^"]*\)".*/\1/p' \
        "$(cd "$1" && GOFLAGS=-mod=mod "$GO" mod download -json "$2" | sed -n 's#^\t"Info": "\(.*\)",#\1#p')"
}

# gobuild_promote NAME...: replace OUT/NAME with the finished OUT/NAME.tmp.
gobuild_promote() {
    local d
    for d in "$@"; do rm -rf "${OUT:?}/$d" && mv "$OUT/$d.tmp" "$OUT/$d"; done
}

# gobuild_finish PRINT LINE...: write the stamp (LINEs, build time and seconds) and print PRINT.
gobuild_finish() {
    local print="$1" elapsed=$(( $(date +%s) - START ))
    shift
    { printf '%s\n' "$@"; echo "built=$(date -u +%FT%TZ)"; echo "seconds=$elapsed"; } >"$STAMP"
    echo "built in ${elapsed}s; $(du -sh "$OUT/bin" | cut -f1) of binaries" >&2
    echo "$print"
}

# gobuild_bump_wrapper DIR MAJOR MODULE TOOL VERSION WHAT: rewrite DIR/go.mod as a wrapper
# module pinning MODULE at VERSION (which must be MAJOR.N.P) with TOOL as its tool, and
# regenerate DIR/go.sum.
gobuild_bump_wrapper() {
    local dir="$1" major="$2" module="$3" tool="$4" v="$5" what="$6" script="hack/${1##*/}/build.sh"
    [[ "$v" =~ ^$major\.[0-9]+\.[0-9]+$ ]] || { echo "usage: $script --bump $major.N.P" >&2; exit 2; }
    {
        echo "// Wrapper module: builds $what from the Go module proxy ($script)."
        echo "// The $module require is the pin; regenerate with $script --bump $major.N.P."
        echo "module instaslice.local/${dir##*/}"
        echo
        echo "go $("$GO" env GOVERSION | sed 's/^go\([0-9]*\.[0-9]*\).*/\1.0/')"
        echo
        echo "require $module $v"
        echo
        echo "tool $tool"
    } >"$dir/go.mod"
    rm -f "$dir/go.sum"
    (cd "$dir" && GOFLAGS=-mod=mod "$GO" mod tidy)
    echo "hack/${dir##*/}/go.mod now pins $module $(gobuild_pin "$dir/go.mod" "$module")"
}
