#!/usr/bin/env bash
# SASS check of the sm90 W4A8 one-warpgroup GEMM kernels in a built binary (no GPU needed):
#   - every kernel issues QGMMA (the decoded e4m3 weights reach the tensor cores through wgmma);
#   - no kernel touches local memory (a spill in these loops costs more than it saves: the
#     160-token loop, overlapped, took 255 registers and spilled, docs/perf/2026-11-29-h200-w4a8-v43.md);
#   - the overlapped kernels (template flag kOverlap, the ...ELb1EE suffix) decode under the MMA:
#     between the last QGMMA of a block and the WARPGROUP.DEPBAR that waits for it there are at
#     least 16 PRMT (one block's table lookups). v38 found ptxas placing such a decode after the
#     wait, which makes the overlap a no-op without any warning.
# It prints, per kernel, every loop over a QGMMA (a backward branch: the K loops, then the item
# loops around them) as instructions / 128-K blocks per iteration, to compare before and after
# changing a kernel.
# Usage: check_sass_w4a8.sh BINARY [CUOBJDUMP]
set -euo pipefail
bin=${1:?usage: check_sass_w4a8.sh BINARY [CUOBJDUMP]}
cuobjdump=${2:-cuobjdump}
sass=$(mktemp)
trap 'rm -f "$sass"' EXIT
"$cuobjdump" -sass "$bin" > "$sass"
awk '
  function hex(s,   v, i, c) {  # "0x..." or "...": its value (POSIX awk has no strtonum)
    sub(/^0x/, "", s); v = 0
    for (i = 1; i <= length(s); i++) { c = index("0123456789abcdef", substr(s, i, 1)); v = v * 16 + c - 1 }
    return v
  }
  function flush(   i, j, body, nq, loops) {
    if (fn == "") return
    loops = ""
    for (i = 0; i < n; i++) {
      if (tgt[i] < 0) continue
      nq = 0
      for (j = tgt[i]; j <= i; j++) if (op[j] ~ /QGMMA/) nq++
      if (nq > 0) loops = loops (i - tgt[i] + 1) "/" nq / 4 " "
    }
    printf "  %-44s QGMMA %3d, local %d, PRMT under the MMA %3d, loops over QGMMA (instructions/blocks): %s\n", short, qgmma, local, under, loops
    if (qgmma == 0) { print "check_sass_w4a8: FAIL: no QGMMA in " fn; failed = 1 }
    if (local > 0) { print "check_sass_w4a8: FAIL: local memory (spills) in " fn; failed = 1 }
    if (overlapped && under < 16) { print "check_sass_w4a8: FAIL: " fn " is overlapped but decodes after the wgmma wait"; failed = 1 }
  }
  /Function : / {
    flush()
    fn = ""
    if ($3 !~ /w4a8_grouped_gemm_kernel/) next
    fn = $3; kernels++
    short = fn
    sub(/^_ZN7megamoe7kernels4sm90[0-9]+/, "", short)
    sub(/EvNS1_.*/, "", short)
    overlapped = (fn ~ /ELb1EEEvNS1_/)
    qgmma = 0; local = 0; under = 0; best = 0; counting = 0; prmt = 0; n = 0
    split("", addr); split("", op); split("", tgt); split("", index_of)
    next
  }
  fn == "" { next }
  !/^ +\/\*[0-9a-f]+\*\// { next }
  {
    a = $1; gsub(/[\/*]/, "", a); a = hex(a)
    line = $0; sub(/^ +\/\*[0-9a-f]+\*\/ +/, "", line); sub(/ *;.*/, "", line)
    index_of[a] = n; addr[n] = a; op[n] = line; tgt[n] = -1
    if (line ~ /BRA/ && match(line, /0x[0-9a-f]+/)) {
      t = hex(substr(line, RSTART, RLENGTH))
      if (t <= a && (t in index_of)) tgt[n] = index_of[t]
    }
    n++
    if (line ~ /QGMMA/) { qgmma++; counting = 1; prmt = 0 }
    else if (line ~ /WARPGROUP\.DEPBAR/) { if (counting && prmt > under) under = prmt; counting = 0 }
    else if (counting && line ~ /PRMT/) prmt++
    if (line ~ /(^|[ @!A-Z0-9]+ )(LDL|STL)([ .]|$)/) local++
  }
  END {
    flush()
    if (kernels == 0) { print "check_sass_w4a8: no W4A8 GEMM kernels found in the binary"; exit 1 }
    if (failed) exit 1
    printf "check_sass_w4a8: all %d W4A8 one-warpgroup GEMM kernels issue QGMMA without spills; the overlapped ones decode under the MMA\n", kernels
  }
' "$sass"
